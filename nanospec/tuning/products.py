"""Fast mode's matrix products by row count (`--kernels tuned`, the default on a CPU): the table of
model.Kernels, tuned here per machine and cached (the forms run in model.py).

A forward of a few rows on a CPU is bound by reading the weights, yet eager `F.linear` handles
a small row count almost row by row. The same product written weight-first, `(W @ x.T).T`, or
against a transposed copy of the weight, `x @ W.T`, can cost a fraction of that at a few rows.
Which wins depends on the shape, the row count and the machine, so nothing is assumed: tune()
times each form on the model's own weights (every layer of a shape, streamed, as a forward reads
them), per row bucket, once, and the table is cached beside the cost measurements.

A row count can also be slow in every form (BLAS kernels favour some widths). So a product may
run on more rows than it has, zero rows added and their results dropped, when tune() measured
the larger count faster: a forward's cost then never rises from n rows to n+1 below a bucket
edge, and the planner gets the rows it pays for (costs.measure sees the padded forward).

A fourth form, where PyTorch has oneDNN, runs against a copy of the weight packed once in oneDNN's
blocked layout: eager products repack the weight on every call, which at 8-64 rows costs as much as
the arithmetic (on this project's 2-core CPU: SmolLM2's products at 8 rows 42 -> 27 ms, at 32 rows
91 -> 55 ms; RESULTS.md, "Packed weights").

Exact mode never uses the table: there AR and every method share one kernel. Fast mode promises
AR's tokens, not its bits (the benchmark counts mismatches), and AR runs the same table at one row.
"""
import hashlib
import json
import sys
import time

import torch

from ..io.files import atomic_write, cache_root, fingerprint, hardware
from ..model import BUCKETS, FORMS, PREPARE, Kernels

PAD_MARGIN = 0.1  # run a product on more rows only if that measured at least 10% faster


def to_json(k: Kernels) -> str:
    return json.dumps([[*key, *v] for key, v in k.table.items()])


def from_json(text: str) -> Kernels:
    return Kernels({tuple(row[:3]): tuple(row[3:]) for row in json.loads(text)})


def tuned(model) -> Kernels:
    """The model's table on this machine: tuned once, then read from the cache root."""
    w = model.embed.weight
    key = f"{fingerprint(model)}-{hardware(w.device)}-{w.dtype}-{'-'.join(sorted(FORMS))}"
    path = cache_root() / "kernels" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.is_file():
        return from_json(path.read_text())
    print(f"tuning fast mode's matrix products for this machine (once; cached in {path.parent})...",
          file=sys.stderr, flush=True)
    k = tune(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(to_json(k)))
    return k


@torch.inference_mode()
def tune(model, buckets=BUCKETS, reps: int = 4) -> Kernels:
    """Time every form for every weight shape of the model and row bucket; each bucket keeps the
    fastest (form, rows) of its own and the larger buckets up to twice its rows."""
    shapes = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), []).append(m.weight)
    table = {}
    for (N, K), ws in shapes.items():
        best = {}  # (form, rows) -> seconds
        ps = {name: [PREPARE[name](w.detach()) if name in PREPARE else None for w in ws] for name in FORMS}
        for b in buckets:
            x = torch.randn(b, K, dtype=ws[0].dtype, device=ws[0].device)
            for name, f in FORMS.items():
                times = []
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    for w, p in zip(ws, ps[name]):
                        f(x, w, p)
                    times.append(time.perf_counter() - t0)
                best[(name, b)] = min(times[1:])
        for b in buckets:  # more rows only when clearly faster: timings on a shared machine are noisy
            own = min((k for k in best if k[1] == b), key=best.get)
            more = min((k for k in best if b < k[1] <= 2 * b), key=best.get, default=own)
            table[(N, K, b)] = more if best[more] < (1 - PAD_MARGIN) * best[own] else own
    return Kernels(table)
