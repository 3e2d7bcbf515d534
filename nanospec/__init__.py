"""nanospec: exact, minimal implementations of lossless multi-token decoding for Llama models."""
import sys


class NanospecError(Exception):
    """Bad input (weights, prompt, options). Entry scripts print the message as one line."""


def cli(main) -> None:
    """Run an entry script's main(): bad input ends as one `error:` line and exit code 2."""
    try:
        sys.exit(main())
    except NanospecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
