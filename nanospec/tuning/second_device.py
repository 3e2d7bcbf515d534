"""A second device on the CPU: what a command puts on "cuda" computes on the host but stands apart, and an op that
mixes it with host tensors fails as it does on a GPU. So a CPU-only suite sees a tensor that `--device cuda` left
behind (a model, a batch, a module a trainer writes), and the work a step does on the device around its program,
launches and syncs, is counted the same on any machine (counts.py).

Its tensors wrap host tensors and show the device "lazy", which nothing here uses: autograd asks a tensor's device for
its stream, and a CPU build of torch has no CUDA device to ask, while lazy answers. CUDA's own exceptions are kept: a
0-dim host tensor is a scalar, indices may stay on the host, a copy crosses devices; `.numpy()` of a device tensor is
refused. What it leaves out: code that asks for a "cuda" device type sees "lazy" (no CUDA graphs, no block batch, and
not the CPU's exact layout either, so bits are the GPU's own check); inference_mode runs as no_grad; torch.compile
does not run on it."""
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

SHOWN = torch.device("lazy")  # what the stand-in's tensors say their device is
aten = torch.ops.aten
CROSSING = {aten.copy_, aten._to_copy}
HOST_INDICES = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class OnDevice(torch.Tensor):
    """A host tensor that stands on the second device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                               storage_offset=inner.storage_offset(), device=SHOWN)
        t.inner = inner
        return t

    def __reduce_ex__(self, protocol):  # torch.save: as its host tensor
        return self.inner.__reduce_ex__(protocol)

    def __repr__(self, **kwargs):
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented  # Device (the mode) runs every op


def to_device(d) -> bool:
    return d is not None and torch.device(d).type in ("cuda", SHOWN.type)


class Device(TorchDispatchMode):
    """Every op: refuse a mix of device and host tensors (as CUDA does), run it on the host, and put its outputs on the
    device where an input was there or its `device` says so. Tally counts what reaches the device."""

    def __init__(self, tally: "Tally | None" = None):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on = any(isinstance(t, OnDevice) for t in tensors)
        if self.tally is not None and (on or to_device(kwargs.get("device"))) and not func.is_view:
            copy = func.overloadpacket
            self.tally.op(func, on and (copy is aten._to_copy and "device" in kwargs and not to_device(kwargs["device"])
                                        or copy is aten.copy_ and not isinstance(args[0], OnDevice)))
        host = [t for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
        if func.overloadpacket in HOST_INDICES and isinstance(args[0], OnDevice):
            host = [t for t in host if not any(t is i for i in args[1])]
        if on and host and func.overloadpacket not in CROSSING:
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found at least two "
                               "devices, cuda:0 and cpu! (the second-device stand-in)")
        made_there = to_device(kwargs.get("device"))
        if made_there:
            kwargs["device"] = torch.device("cpu")
        inner = lambda t: t.inner if isinstance(t, OnDevice) else t  # noqa: E731
        out = func(*tree_map(inner, args), **tree_map(inner, kwargs))
        if func.overloadpacket is aten._to_copy and "device" in kwargs and not made_there:
            return out  # to the host
        if func.overloadpacket is aten.copy_ and not isinstance(args[0], OnDevice):
            return args[0]
        if not (on or made_there):
            return out
        given = {id(t.inner): t for t in tensors if isinstance(t, OnDevice)}  # in place: the same tensor back

        def there(t):
            return t if type(t) is not torch.Tensor else given[id(t)] if id(t) in given else OnDevice(t)
        return tree_map(there, out)


class Moves(TorchFunctionMode):
    """What checks for a CUDA build before it reaches an op: Tensor.to and .cuda, torch.tensor given a device; and
    .tolist and .numpy, which read the data."""

    def __init__(self, tally: "Tally | None" = None):
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            rest = {k: v for k, v in kwargs.items() if k != "copy"}
            parsed = (SHOWN, None) if func is torch.Tensor.cuda else torch._C._nn._parse_to(*args[1:], **rest)
            device, dtype = parsed[:2]
            if to_device(device):
                there = isinstance(args[0], OnDevice) and not kwargs.get("copy")
                t = args[0] if there else aten._to_copy(args[0], device=SHOWN)
                return t if dtype is None else t.to(dtype)
        elif func in (torch.tensor, torch.as_tensor) and to_device(kwargs.get("device")):  # made, then moved
            with torch._C.DisableTorchFunction():
                out = func(*args, **{**kwargs, "device": "cpu"})
            return tree_map(lambda t: aten._to_copy(t, device=SHOWN) if isinstance(t, torch.Tensor) else t, out)
        elif func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice) and "device" not in kwargs:
            return aten._to_copy(args[0].inner.new_tensor(*args[1:], **kwargs), device=SHOWN)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnDevice):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)  # a list index: made on the host
            index = tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
            return func(args[0], index if isinstance(args[1], tuple) else index[0], *args[2:])
        elif func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            if self.tally is not None:
                self.tally.read()
            return args[0].inner.tolist()
        elif func is torch.Tensor.numpy and isinstance(args[0], OnDevice):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                            "host memory first. (the second-device stand-in)")
        return func(*args, **kwargs)


class NoGrad:
    """inference_mode's context as no_grad: inference tensors refuse a wrapper's version counter."""

    def __init__(self, enabled=True):
        self.ctx = torch.no_grad() if enabled else contextlib.nullcontext()

    def __enter__(self):
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


class Tally:
    """What a run does on the device outside its programs: launches (ops on device tensors, copies to it or
    from it) and syncs (a read of device data on the host: .tolist(), .item(), a copy to the host; a
    synchronize). `inside` pauses the count while a program runs: it is one launch."""

    def __init__(self):
        self.launches = self.syncs = self.depth = 0

    def op(self, func, to_host: bool) -> None:
        if self.depth:
            return
        self.launches += 1
        if to_host or func.overloadpacket is aten._local_scalar_dense:
            self.syncs += 1

    def read(self) -> None:  # .tolist() of device data: a copy to the host, and a wait for it
        if not self.depth:
            self.launches += 1
            self.syncs += 1

    def synchronize(self, device=None) -> None:
        if not self.depth:
            self.syncs += 1

    @contextlib.contextmanager
    def inside(self):
        if not self.depth:
            self.launches += 1
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


@contextlib.contextmanager
def patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def second_device(tally: Tally | None = None):
    """Within: `--device cuda` runs on the stand-in (torch.cuda says a device is there, and its sync waits for
    nothing, or is counted by tally)."""
    sync = tally.synchronize if tally is not None else lambda device=None: None
    with contextlib.ExitStack() as stack:
        for name, value in (("_lazy_init", lambda: None), ("is_available", lambda: True),
                            ("get_device_name", lambda device=None: "the second-device stand-in"),
                            ("synchronize", sync)):
            stack.enter_context(patched(torch.cuda, name, value))
        stack.enter_context(patched(torch._C, "_InferenceMode", NoGrad))
        with Device(tally), Moves(tally):
            yield
