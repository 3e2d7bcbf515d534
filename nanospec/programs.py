"""How exact mode's device programs run as CUDA graphs (Graphs); without a Programs the engine runs them eagerly.

Exact mode runs every forward with the same shapes: Q rows against a cache of S slots, each row gathering the same
number of keys. That is what a CUDA graph needs. A program is captured once per key (a step's: the drafter, greedy
or sampled, and for a method with group rows its tree and group size; prefill's: its inputs) and shape, then
replayed: one launch instead of hundreds of kernel launches from Python, which bound an eager step on a GPU (its
wall time is the host's launches, not the GPU's work).

Bitwise equality with AR survives by construction: AR's exact forward replays the same captured graph (same
kernels, same shapes) as every method's, and a replay runs exactly the kernels the eager capture chose
(tests/test_graphs.py checks graph == eager).

A graph is bound to the addresses of its static inputs, its outputs and the KV cache it writes, so graphs live
with the cache they were captured with, and Graphs keeps one cache per (S, batch, dtype) per model alive across
generations. It is CUDA's default (`of`) unless NANOSPEC_CUDA_GRAPHS=0.

Without a GPU, Simulated (tests) stands in for capture on the CPU: each program is traced once into its tensor
ops (make_fx) and replayed without running its Python again. The trace refuses what a capture refuses: an op that
makes the host read a device value (a sync), a host value copied in (`torch.tensor(...)`, a Python scalar written
by index: make_fx's `lift_fresh`; Strict), and a tensor made without a device (`torch.zeros(n)`: on a GPU a host
tensor inside a device program; NoHostTensors). A program that would break under a real graph, by any of these or
by reading state its key does not name, fails there too.
"""
import os
import sysconfig
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .devices import CUDA, Device


def graphs_enabled() -> bool:
    """Exact mode on CUDA runs as CUDA graphs unless NANOSPEC_CUDA_GRAPHS=0 (then eagerly)."""
    return os.environ.get("NANOSPEC_CUDA_GRAPHS", "1") != "0"


class Programs:
    """How a generation's device programs (a step, a prefill chunk) run, and on which cache: here as the Python
    they are, on a new cache each time (EAGER: what wrappers that count or profile run). Graphs runs exact mode's
    as CUDA graphs, bound to caches it keeps."""

    def cache(self, model, key, make):
        """The cache for model at key (its slots, batch, dtype and device): make() builds one."""
        return make()

    def run(self, cache, key, fn, args, device):  # key: the program's name (a capture's, with the shapes)
        return fn(*(None if a is None else a.to(device) for a in args))


EAGER = Programs()


class Graph:
    """fn(*args) captured on static copies of args (tensors or None); call it with new values
    of the same shapes. fn must do no host syncs, and everything it reads that is not in args
    (weights, the cache, index tensors in its closure) must stay where it is: the graph keeps
    fn, and so its closure, alive."""

    def __init__(self, fn, args, device):
        self.fn = fn
        self.args = [None if a is None else a.to(device, copy=True) for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation (cuBLAS handles) stays outside the capture
            fn(*self.args)  # writes the same keys/values the replay will write: harmless
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.args)

    def __call__(self, args):
        """The outputs, valid until the next replay overwrites them (the engine reads a step's back at once)."""
        for static, a in zip(self.args, args):
            if static is not None:
                static.copy_(a, non_blocking=True)
        self.graph.replay()
        return self.out


class Strict(TorchDispatchMode):
    """Refuses what a CUDA graph's capture refuses, naming the op and the line that called it: a host
    read of a device value (a sync), a host value copied into the program, a tensor made on the host."""
    SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal", "aten::is_nonzero"}
    HOST_VALUES = {"aten::lift_fresh", "aten::lift_fresh_copy"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func._schema.name, kwargs or {}
        if name in self.SYNCS or func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            refuse(f"{name} reads a device value on the host")
        if name in self.HOST_VALUES:
            refuse(f"{name} copies a host value in (torch.tensor(...), or a Python scalar written by index)")
        return func(*args, **kwargs)


class NoHostTensors(TorchFunctionMode):
    """Refuses a tensor made without a device inside a program: on a GPU it would be a host tensor."""
    FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                 torch.eye, torch.rand, torch.randn, torch.randint, torch.linspace, torch.scalar_tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            refuse(f"torch.{func.__name__} makes a tensor without a device (on a GPU, a host tensor)"
                   + (" and copies a host value in" if func in (torch.tensor, torch.as_tensor) else ""))
        return func(*args, **kwargs)


def refuse(what: str):
    """A RuntimeError naming what a program did and the innermost line of ours (not torch's) that did it."""
    lib = (sysconfig.get_paths()["stdlib"], os.path.dirname(torch.__file__), __file__)
    here = [f for f in traceback.extract_stack() if not f.filename.startswith(lib)]
    at = f" at {here[-1].filename}:{here[-1].lineno} ({here[-1].line})" if here else ""
    raise RuntimeError(f"{what}{at}: not allowed in a CUDA graph")


class Traced:
    """The CPU stand-in for a Graph (Simulated): fn traced once into its ops (Strict), then replayed."""

    def __init__(self, fn, args, device):
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        self.args = [None if a is None else a.to(device, copy=True) for a in args]
        try:  # one fake mode for the nodes' metadata (else make_fx makes one per value, each costly to make)
            with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))), NoHostTensors(), Strict():
                self.gm = make_fx(fn)(*self.args)
        except RuntimeError as e:
            if "get value out of a tracing tensor" not in str(e):
                raise
            raise RuntimeError("the program reads a device value on the host (.item(), int(), a tensor "
                               "index): not allowed in a CUDA graph") from None

    def __call__(self, args):
        for static, a in zip(self.args, args):
            if static is not None:
                static.copy_(a)
        return self.gm(*self.args)

    def __reduce_ex__(self, protocol):  # what copy.deepcopy and pickle call
        raise TypeError("cannot pickle 'CUDAGraph' object: the stand-in refuses a copy, as a captured graph does "
                        "(a drafter copied with the model, say)")


class Graphs(Programs):
    """Exact mode's programs as CUDA graphs: each captured once per cache, key and shapes, then replayed.
    Host tensors are copied straight into a graph's static inputs. It keeps one cache per model and key, emptied
    for each generation, so its graphs stay valid as long as the model lives."""
    capture = Graph

    def __init__(self):
        self.caches = weakref.WeakKeyDictionary()  # model -> {key: its cache}
        self.graphs = weakref.WeakKeyDictionary()  # cache -> {(program key, shapes): its graph}

    def cache(self, model, key, make):
        pool = self.caches.setdefault(model, {})
        if key in pool:
            pool[key].reset()
        else:
            pool[key] = make()
        return pool[key]

    def run(self, cache, key, fn, args, device):
        graphs = self.graphs.setdefault(cache, {})
        key = shaped(key, args)
        if key not in graphs:
            graphs[key] = self.capture(fn, args, device)
        return graphs[key](args)


GRAPHS = Graphs()  # CUDA's: its captures live with the caches it keeps, for the whole process


def of(dev: Device) -> Programs | None:
    """How exact mode's programs run on a device: its own (Device.programs), else CUDA graphs on CUDA (unless
    NANOSPEC_CUDA_GRAPHS=0), else eagerly (None)."""
    if dev.programs is not None:
        return dev.programs
    return GRAPHS if isinstance(dev, CUDA) and graphs_enabled() else None


def shaped(key, args) -> tuple:
    """A program's key with its arguments' shapes and dtypes: what one capture (or trace) serves."""
    return key, *(None if a is None else (tuple(a.shape), a.dtype) for a in args)


class Simulated(Graphs):
    """The CPU stand-in for Graphs (tests): every program traced once (Traced), then replayed."""
    capture = Traced
