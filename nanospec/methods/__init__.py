"""Method registry: name -> loader(model, weights_dir, **options) returning a Drafter.

A method is named by a spec, "name" or "name:key=value,key=value", e.g.
`lookahead:strategy=parallel,decoding_length=16`; the options are the loader's
keyword arguments. Each method file registers itself here as it lands; `ar` is
the baseline every method must reproduce.
"""
import inspect

from .. import NanospecError
from ..engine import Drafter
from . import bita, hidden_transfer, lookahead, medusa, propd, sdsat

METHODS = {
    "ar": lambda model, weights: Drafter(),
    "lookahead": lookahead.load,
    "medusa": medusa.load_medusa,
    "propd": propd.load_propd,
    "bita": bita.load_bita,
    "hidden_transfer": hidden_transfer.load_hidden_transfer,
    "sdsat": sdsat.load_sdsat,
}
OWN_MODEL = {"sdsat": sdsat.model_dir}  # methods that decode a fine-tuned model of their own


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
    model (SDSAT), which is then also the AR reference. `ar` follows the others."""
    names = {parse_spec(s)[0] for s in specs} - {"ar"}
    dirs = {OWN_MODEL[n](weights) if n in OWN_MODEL else weights for n in names} or {weights}
    if len(dirs) > 1:
        raise NanospecError(f"{', '.join(sorted(names))} decode different models ({', '.join(map(str, sorted(dirs)))}); "
                            "benchmark them in separate runs")
    return dirs.pop()


def load_drafter(spec: str, model, weights) -> Drafter:
    name, kwargs = parse_spec(spec)
    drafter = METHODS[name](model, weights, **kwargs)
    drafter.name = spec
    return drafter
