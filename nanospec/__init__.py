"""nanospec: exact, minimal implementations of lossless multi-token decoding for Llama models."""


class NanospecError(Exception):
    """Bad input (weights, prompt, options). Entry scripts print the message as one line."""
