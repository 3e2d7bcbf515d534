"""Method registry: name -> loader(model, weights_dir, **options) returning a Drafter.

A method is named by a spec, "name" or "name:key=value,key=value", e.g.
`lookahead:strategy=parallel,decoding_length=16`; the options are the loader's
keyword arguments. METHODS below maps each name to its loader; a new method is
added to it by hand. `ar` is the baseline every method must reproduce.
"""
import inspect
import json
from pathlib import Path

from safetensors import safe_open

from .. import NanospecError
from ..drafter import AR, Drafter
from ..io.files import fingerprint
from . import bita, hidden_transfer, lookahead, medusa, propd, sdsat, sdsat_full

METHODS = {
    "ar": lambda model, weights: AR,
    "lookahead": lookahead.load,
    "medusa": medusa.load_medusa,
    "propd": propd.load_propd,
    "bita": bita.load_bita,
    "hidden_transfer": hidden_transfer.load_hidden_transfer,
    "sdsat": sdsat.load_sdsat,
    "sdsat_full": sdsat_full.load,
}
OWN_MODEL = {"sdsat_full": sdsat_full.model_dir}  # methods that decode a fine-tuned model of their own


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
    allowed = [p for p in inspect.signature(METHODS[name]).parameters if p not in ("model", "weights")]
    for key in kwargs:
        if key not in allowed:
            raise NanospecError(f"{name} has no option {key!r}; its options: {', '.join(allowed) or 'none'}")
    return name, kwargs


def split_specs(methods: str) -> list[str]:
    """'ar,lookahead:strategy=single,decoding_length=8' -> ['ar', 'lookahead:strategy=single,decoding_length=8']:
    a piece with '=' and no ':' continues the spec before it."""
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
    dirs = {OWN_MODEL[n](weights) if n in OWN_MODEL else weights for n in names} or {weights}
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
    drafter = METHODS[name](model, weights, **kwargs)
    drafter.name = spec
    return drafter
