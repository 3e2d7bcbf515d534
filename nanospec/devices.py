"""A device as the core sees it: a value handed to the model and the engine, never patched into them.

Exact mode promises that a row's bits never depend on where it sits: its index in the block, the rows beside it,
the batch. Each device's kernels keep that promise on their own terms, and what a device needs for it lives here:
- aligned(x): a product's left operand as the device's products need it (a CPU's BLAS: every row 64-byte aligned);
- elementwise(fn, x): an elementwise kernel run so that every element takes the same code path (a CPU's scalar
  remainders);
- slot_grain, grain(dtype): the multiples a cache's slots and head width are laid out at (a CPU: aligned score and
  value rows);
- block_batch: the sequences' blocks every exact forward runs by default (CUDA: cuBLAS picks a kernel by total rows);
- sync(device): how the host waits for the device (timing, a step's read-back needs none).
Its speed rides along, as values too: `programs` (how exact mode's device programs run, programs.py; None: the device
type's default there, CUDA graphs on a GPU), `call` (exact mode's layer as one callable: compiled.py) and `forms`
(the product forms of fast mode's forwards and of every mode's proposals, whose bits need not be AR's:
tuning/products.py). `of(device)` gives a device type's defaults; a caller passes another with dataclasses.replace.
The base class is a GPU's view: one kernel applies the same code to every row and element of a fixed shape.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Exact mode's fewest rows per forward, on every device: MKL computes the last rows of a GEMM with 5-11 rows on
# another path than the first ones (tests/test_model.py checks blocks of 16 and more).
MIN_BLOCK = 16


@dataclass(frozen=True)
class Device:
    programs: object = None     # how exact mode's programs (a step, a prefill) run (programs.Programs; None: default)
    call: object = None         # exact mode's layer as fn(layer, x, ctx, kv) (None: the layer's own forward)
    forms: object = None        # products as forms(proj, x): fast mode's, and every mode's proposals (None: F.linear)
    block_batch = None          # sequences' blocks per exact forward by default (None: the live ones)
    slot_grain = 1              # a cache's slots, and exact mode's gathered keys, in multiples of this

    def aligned(self, x):
        return x

    def elementwise(self, fn, x):
        return fn(x)

    def grain(self, dtype) -> tuple[int, int]:
        return self.slot_grain, 1

    def sync(self, device) -> None:
        pass


@dataclass(frozen=True)
class CPU(Device):
    """A CPU's BLAS takes alignment-dependent paths, and its elementwise kernels finish each thread's run of SIMD
    chunks with a scalar loop that disagrees with the SIMD path in the last bit on a few inputs in a hundred."""
    slot_grain = 32  # every score row 64-byte aligned

    def aligned(self, x):
        """x as a view whose rows start 64-byte aligned (the last dim's stride padded): with fp32 rows of odd
        length a row's product would otherwise depend on its index."""
        pad = -x.shape[-1] % (64 // x.element_size())
        return F.pad(x, (0, pad))[..., :x.shape[-1]] if pad else x

    def elementwise(self, fn, x):
        """Rows padded to 64 elements, in calls small enough for one thread (PyTorch's grain is 32768 elements),
        take the SIMD path only."""
        D = x.shape[-1]
        Dp = D - D % -64
        rows = F.pad(x, (0, Dp - D)).reshape(-1, Dp)
        out = torch.cat([fn(c) for c in rows.split(max(1, 32768 // Dp))])
        return out[:, :D].reshape(x.shape)

    def grain(self, dtype) -> tuple[int, int]:
        """Every score and value row 64-byte aligned: slots in 32s, a head's width in 64 bytes."""
        return self.slot_grain, 64 // dtype.itemsize


@dataclass(frozen=True)
class CUDA(Device):
    """cuBLAS picks its fp32 kernel by a product's total rows: a fixed total of 8 sequences' blocks, whoever is
    live, keeps a sequence's bits those of it alone (sizes.block_batch). Exact mode's programs are CUDA graphs
    (programs.of)."""
    block_batch = 8

    def sync(self, device) -> None:
        torch.cuda.synchronize(device)


DEVICES = {"cpu": CPU(), "cuda": CUDA()}


def of(device) -> Device:
    """The defaults of a device (a torch.device, its name, or a tensor's), or a Device as it is."""
    if isinstance(device, Device):
        return device
    kind = device.device.type if isinstance(device, torch.Tensor) else torch.device(device).type
    return DEVICES.get(kind, Device())
