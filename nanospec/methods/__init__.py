"""Method registry: name -> the method's Drafter class, the one list of methods (decode.py's choices, the bench's
`--methods all`, and every generic test, which runs each method by its name: `python -m pytest -k NAME`).

A method is named by a spec, "name" or "name:key=value,key=value", e.g.
`lookahead:strategy=parallel,decoding_length=16`; the options are its loader's
(Drafter.load) keyword arguments. A new method is its file and one line here.
`ar` is the baseline every method must reproduce.
"""
import inspect
import json
from pathlib import Path

from safetensors import safe_open

from .. import NanospecError
from ..drafter import Drafter
from ..io.files import fingerprint
from . import bita, hidden_transfer, lookahead, medusa, pld, propd, sdsat, sdsat_full

METHODS: dict[str, type[Drafter]] = {
    "ar": Drafter,
    "lookahead": lookahead.Lookahead,
    "pld": pld.PLD,
    "medusa": medusa.Medusa,
    "propd": propd.ProPD,
    "bita": bita.BiTA,
    "hidden_transfer": hidden_transfer.HiddenTransfer,
    "sdsat": sdsat.SDSAT,
    "sdsat_full": sdsat_full.SDSATFull,
}


def _value(v: str):
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_spec(spec: str) -> tuple[str, dict]:
    name, _, opts = spec.partition(":")
    if name not in METHODS:
        raise NanospecError(f"unknown method {name!r}; choose from: {', '.join(METHODS)}")
    kwargs = {}
    for kv in filter(None, opts.split(",")):
        key, eq, val = kv.partition("=")
        if not eq:
            raise NanospecError(f"method option {kv!r} in {spec!r} is not key=value")
        kwargs[key.strip()] = _value(val.strip())
    allowed = [p for p in inspect.signature(METHODS[name].load).parameters if p not in ("model", "weights")]
    for key in kwargs:
        if key not in allowed:
            raise NanospecError(f"{name} has no option {key!r}; its options: {', '.join(allowed) or 'none'}")
    return name, kwargs


def split_specs(methods: str) -> list[str]:
    """'ar,lookahead:strategy=single,decoding_length=8' -> ['ar', 'lookahead:strategy=single,decoding_length=8']:
    a piece with '=' and no ':' continues the spec before it. 'all': every method that decodes the base model."""
    if methods == "all":
        return [n for n, m in METHODS.items() if m.model_dir is Drafter.model_dir]
    specs = []
    for piece in methods.split(","):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def check_method(spec: str) -> None:
    parse_spec(spec)


def model_dir(specs: list[str], weights):
    """The model directory the methods decode: the base weights, or a method's own fine-tuned
    model (the paper's SDSAT, sdsat_full), which is then also the AR reference. `ar` follows the others."""
    names = {parse_spec(s)[0] for s in specs} - {"ar"}
    dirs = {METHODS[n].model_dir(weights) for n in names} or {weights}
    if len(dirs) > 1:
        raise NanospecError(f"{', '.join(sorted(names))} decode different models "
                            f"({', '.join(map(str, sorted(dirs)))}); "
                            "benchmark them in separate runs")
    return dirs.pop()


SHIPPED = Path(__file__).resolve().parents[2] / "weights"  # the repository's drafters, one directory per base model


def trained_for(path: Path) -> str | None:
    """The base fingerprint a drafter file names (its metadata only; no tensor is read)."""
    try:
        with safe_open(path, framework="pt") as f:
            return json.loads((f.metadata() or {}).get("base_fingerprint", "null"))
    except Exception:  # not a drafter file (a model's weights, a damaged file)
        return None


def drafters_for(model, weights, given=None) -> Path:
    """Where the model's drafters are: `given` (--drafters), else the weights directory if it holds a
    drafter trained for this model, else the shipped directory (weights/*/) that does, found by the
    model's fingerprint, whatever the weights came from (a directory, a GGUF, a hub id) and whatever
    dtype they run in. Else the weights directory: a missing drafter is reported there."""
    if given is not None:
        if not Path(given).is_dir():
            raise NanospecError(f"--drafters {given}: no such directory")
        return Path(given)
    fp = fingerprint(model)
    for d in [Path(weights), *sorted(p for p in SHIPPED.glob("*") if p.is_dir())]:
        if any(trained_for(f) == fp for f in d.glob("*.safetensors") if f.name != "model.safetensors"):
            return d
    return Path(weights)


def load_drafter(spec: str, model, weights) -> Drafter:
    name, kwargs = parse_spec(spec)
    drafter = METHODS[name].load(model, weights, **kwargs)
    drafter.name = spec
    return drafter
