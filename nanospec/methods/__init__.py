"""Method registry: name -> loader(model, weights_dir) returning a Drafter.

Each method file registers itself here as it lands; `ar` is the baseline every
method must reproduce.
"""
from .. import NanospecError
from ..engine import Drafter

METHODS = {
    "ar": lambda model, weights: Drafter(),
}


def check_method(name: str) -> None:
    if name not in METHODS:
        raise NanospecError(f"unknown method {name!r}; choose from: {', '.join(METHODS)}")


def load_drafter(name: str, model, weights) -> Drafter:
    check_method(name)
    return METHODS[name](model, weights)
