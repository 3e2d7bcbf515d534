"""nanospec: exact, minimal implementations of lossless multi-token decoding for Llama models."""
import argparse
import sys
from pathlib import Path

DEFAULT_WEIGHTS = Path(__file__).resolve().parents[1] / "weights" / "pylm"  # the default model, in the checkout


class NanospecError(Exception):
    """Bad input (weights, prompt, options). Entry scripts print the message as one line."""


def check_device(device: str) -> None:
    """A command line's --device: cuda where there is none is bad input, one line, not a deep traceback."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise NanospecError("--device cuda: no CUDA device is available; use --device cpu")


def cli(main) -> None:
    """Run an entry script's main(): bad input ends as one `error:` line and exit code 2."""
    try:
        sys.exit(main())
    except NanospecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors end like every other bad input: one `error:` line, exit code 2."""

    def __init__(self, **kw):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    def error(self, message):
        raise NanospecError(f"{message} (see --help)")
