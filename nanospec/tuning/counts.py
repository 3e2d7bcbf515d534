"""What an exact step costs a GPU, counted on the CPU, so each figure is the same on any machine.

- ops: the kernels one eager run of a step's program launches (the aten ops of its trace that are neither views
  nor allocations), as a GPU runs it: without the CPU's exact layout.
- MB: the bytes those ops write (an op's outputs; an in-place op's source: a cache write writes its rows, not the
  cache). A step must not write more than it must read: the weights, and the KV cache once.
- compiled kernels: what `--compile` makes of one exact layer on this device (inductor's generated kernels and the
  library products they call), the figure a fused GPU step approaches; the eager ops are the plain code's.
- launches and syncs per step outside the program, on the second-device stand-in (second_device.py), the
  program counted as one launch as a CUDA graph's replay is: the host's work around it (building inputs, copies
  to the device, read-backs, the commit), which a graph does not absorb.
"""
import copy
import re

import torch
from torch.utils._pytree import tree_flatten

from ..devices import Device
from ..engine import AR, generate
from ..programs import Programs, Traced
from .second_device import Tally, second_device

ALLOCATIONS = {"aten::empty", "aten::new_empty", "aten::empty_strided", "aten::empty_like"}  # memory, no kernel


def kernels(gm) -> list:
    """A traced program's nodes that launch a kernel on a GPU: aten ops that are neither views nor allocations."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and not n.target.is_view and n.target._schema.name not in ALLOCATIONS]


def written_mb(gm) -> float:
    """The MB a traced program's kernels write: each one's outputs; an in-place one's, its largest source."""
    total = 0
    for n in kernels(gm):
        first = n.target._schema.arguments[0].alias_info if n.target._schema.arguments else None
        inplace = first is not None and first.is_write
        vals = [t for a in (n.args[1:] if inplace else [n]) for t in tree_flatten(getattr(a, "meta", {}).get("val"))[0]
                if isinstance(t, torch.Tensor)]
        sizes = [t.numel() * t.element_size() for t in vals]
        total += max(sizes, default=0) if inplace else sum(sizes)
    return total / 1e6


class Counted(Programs):
    """Each step program traced once (cuda.Traced, the CPU's stand-in for a capture) and replayed: per program
    key, its kernels and the MB they write. Other programs (prefill) run as they are."""

    def __init__(self):
        self.counts = {}

    def run(self, cache, key, fn, args, device):
        if key[0] != "step":
            return super().run(cache, key, fn, args, device)
        if key not in self.counts:
            traced = Traced(fn, args, device)
            self.counts[key] = (traced, len(kernels(traced.gm)), written_mb(traced.gm))
        return self.counts[key][0](args)


def step_costs(model, drafter=None, steps: int = 3, n_slots=None, batch: int = 1) -> list[tuple[int, float]]:
    """(ops, MB) of each of an exact generation's step programs with drafter (AR: None), as a GPU runs them
    (a GPU's layout: devices.Device, not the CPU's), its own (AR's where it drafted none): batch sequences
    (a block batch of that many) of 8-token prompts on a cache of n_slots. Exact mode's programs have the same
    shapes wherever a prompt ends, so a short one counts what a long one would, without its prefill."""
    drafter = copy.deepcopy(drafter or AR)  # the count leaves a method's state (its trie, its planner) as it was
    counted = Counted()
    prompts = [[1 + (7 * i + j) % 50 for j in range(8)] for i in range(batch)]
    generate(model, prompts, drafter, max_new_tokens=steps, exact=True, eos_id=-1, n_slots=n_slots,
             block_batch=batch if batch > 1 else None, dev=Device(), programs=counted)  # a GPU's layout
    counts = {k: c[1:] for k, c in counted.counts.items()}
    return [c for k, c in counts.items() if k[1] == id(drafter)] or list(counts.values())


def step_ops(model, drafter=None) -> int:
    """The kernels of one exact step of drafter's (AR's: None), its largest program's."""
    return max(ops for ops, _ in step_costs(model, drafter))


def ops_per_layer(model, drafter=None) -> float:
    """step_ops divided by the model's layers: the bench's figure."""
    return step_ops(model, drafter) / model.args.n_layers


def step_mb(model, drafter=None, n_slots: int = 256, batch: int = 1) -> float:
    """The MB the largest of drafter's exact step programs writes, at a cache of n_slots and a block batch of
    `batch` sequences."""
    return max(mb for _, mb in step_costs(model, drafter, 3, n_slots, batch))


class Launches(Programs):
    """A step's program as a captured graph runs it: its inputs copied in, then one launch (the tally's inside)."""

    def __init__(self, tally: Tally):
        self.tally = tally

    def run(self, cache, key, fn, args, device):
        args = [None if a is None else a.to(device) for a in args]
        with self.tally.inside():
            return fn(*args)


def host_work(model, make=lambda model: None, batch: int = 1, block_batch: int = 8,
              steps: tuple = (3, 6)) -> tuple[float, float]:
    """Launches and syncs per greedy exact step outside the step's program, at the CUDA defaults (a block batch),
    on the second-device stand-in: a copy of the model there and make(that model)'s drafter (None: AR), batch
    sequences; per step, the difference between two lengths' counts (prefills and starts cancel)."""
    counts = []
    with second_device():
        there = copy.deepcopy(model).to("cuda")
    for n in steps:
        tally = Tally()
        with second_device(tally):
            d = make(there)
            prompts = [[1 + (7 * i + j) % 50 for j in range(6 + i)] for i in range(batch)]
            start = (tally.launches, tally.syncs)  # what making the drafter did
            outs = generate(there, prompts, d, max_new_tokens=n, exact=True, eos_id=-1, block_batch=block_batch,
                            programs=Launches(tally))
        counts.append((tally.launches - start[0], tally.syncs - start[1], max(o.steps for o in outs)))
    (l1, s1, n1), (l2, s2, n2) = counts
    return (l2 - l1) / (n2 - n1), (s2 - s1) / (n2 - n1)


def compiled_per_layer(model, drafter=None) -> int:
    """The kernels one compiled exact layer launches (compile=True), read off inductor's output code: each call of a
    kernel it generated or of a library product (extern_kernels), over the graphs a short exact run compiles. Every
    layer and every exact forward share one layer's graphs (its shapes are fixed), which exact attention's scores
    written in place (out=, which dynamo leaves to eager) split in several: their eager products are not counted,
    and a method that compiles a variant of its own (SDSAT's adaptive rows) counts both."""
    from torch._inductor.utils import run_and_get_code
    call = re.compile(r"^\s+(extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|aten\.\w+)\(", re.M)
    d = copy.deepcopy(drafter) if drafter is not None else AR
    torch._dynamo.reset()  # a graph compiled earlier in the process would not show its code
    _, codes = run_and_get_code(generate, model, list(range(1, 9)), d, max_new_tokens=3, exact=True, compile=True,
                                eos_id=-1)
    return sum(len(call.findall(code.split("def call(")[-1])) for code in codes)


def step_counts(model, make, drafter, batch: int = 1, compiled: bool = False) -> dict:
    """The bench's figures for a method (make(model): its drafter on another copy of the model; drafter: on this
    one), on a small cache: its step's ops per layer and MB (at a block batch of `batch`), and the launches and
    syncs around it at the CUDA defaults; compiled: also its compiled layer's kernels (compiled_per_layer)."""
    costs = step_costs(model, drafter, 3, None, batch)
    launches, syncs = host_work(model, make, batch)
    return dict(ops_per_layer=round(max(c[0] for c in costs) / model.args.n_layers, 1),
                compiled_kernels_per_layer=compiled_per_layer(model, drafter) if compiled else None,
                step_mb=round(max(c[1] for c in costs), 2), launches_per_step=round(launches, 2),
                syncs_per_step=round(syncs, 2))
