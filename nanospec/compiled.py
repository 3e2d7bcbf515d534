"""compile=True (`decode.py --compile`): exact mode's layer as one torch.compile'd callable.

Every exact program runs its layers through it (forward.Context.layer: the device's `call`): AR's step, every
method's, the prefill, and Hidden Transfer's and ProPD's layer loops. One callable compiled at exact mode's fixed
shapes gives AR and the methods the same fused kernels for the same shapes; that those kernels give a row the same
bits at any index of its block is what tests/test_compile.py checks, method by method: the exactness contract holds
between compiled runs (a compiled run's bits are not an eager run's). On CUDA it runs inside the
step's CUDA graph (programs.py), on a CPU as inductor's C++ kernels. Fast mode runs its layers as they are: its key
count changes every step, and each new shape would compile anew.

A method may compile graphs of its own: SDSAT's adaptive tokens add a product delta (ctx.delta), a new guard.
Inductor on CUDA times candidate configs of a reduction and keeps the fastest, so two graphs of the same ops
could sum in different orders; its deterministic mode (set here) picks configs by rule (RESULTS.md, "On a GPU",
says what a GPU run has checked).

A new shape (block, cache size, batch, dtype) compiles once; the cache of compiled shapes is sized for a run's
handful, and a run that outgrows it fails rather than fall back to eager kernels, whose bits differ.
"""
import time

import torch

from .forward import exact_layer

_layer = None
compiles = []  # the seconds of each call that compiled a new graph: what --compile reports


def options() -> dict:
    """Inductor's settings for the layer: kernels chosen by rule, not by timing them (the header)."""
    import torch._inductor
    return {"deterministic": True} if "deterministic" in torch._inductor.list_options() else {}


def compiled_layer():
    """The one compiled callable, forward.exact_layer: parameters are its inputs, so every layer shares it."""
    global _layer
    if _layer is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.fail_on_cache_limit_hit = True  # never an eager fallback: its bits differ
        _layer = torch.compile(exact_layer, dynamic=False, options=options())
    return _layer


def layer(layer, x, ctx, kv):
    """A layer's exact forward through the compiled callable (a device's `call`: devices.Device)."""
    t = time.perf_counter()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    y = compiled_layer()(layer, x, ctx, kv)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames:
        compiles.append(time.perf_counter() - t)
    return y
