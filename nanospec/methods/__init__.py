"""Method registry: name -> loader(model, weights_dir) returning a Drafter.

Each method file registers itself here as it lands; `ar` is the baseline every
method must reproduce.
"""
from .. import NanospecError
from ..engine import Drafter

METHODS = {
    "ar": lambda model, weights: Drafter(),
}


def load_drafter(name: str, model, weights) -> Drafter:
    if name not in METHODS:
        raise NanospecError(f"unknown method {name!r}; choose from: {', '.join(METHODS)}")
    return METHODS[name](model, weights)
