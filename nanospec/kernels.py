"""Fast mode's matrix products, chosen by row count (opt-in: `--kernels tuned`).

A forward of a few rows on a CPU is bound by reading the weights, yet eager `F.linear` handles
a small row count almost row by row: on 2 cores, SmolLM2's 49,152 x 576 lm_head took 11 ms for
one row and 33 ms for four. The same product written weight-first, `(W @ x.T).T`, took 12 ms for
four; a one-row product against a transposed copy of the weight, `x @ W.T`, took 5.5 ms. Which
wins depends on the shape, the row count and the machine, so nothing is assumed: tune() times
each form on the model's own weights (every layer of a shape, streamed, as a forward reads
them), per row bucket, once, and the table is cached beside the cost measurements.

Exact mode never comes here: there AR and every method share one kernel. Fast mode promises
AR's tokens, not its bits (the benchmark counts mismatches), and AR runs the same table at one row.
"""
import hashlib
import json
import sys
import time

import torch
import torch.nn.functional as F

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FORMS = {
    "linear": lambda x, w, wt: F.linear(x, w),
    "weight-first": lambda x, w, wt: (w @ x.T).T,
    "transposed": lambda x, w, wt: x @ wt,
}


class Kernels:
    """{(out, in, rows bucket): form}: the fastest form of each product on this machine."""

    def __init__(self, table: dict):
        self.table = table
        self.t = {}  # id(weight) -> its transposed copy, for the forms that want one

    def linear(self, layer, x):
        M, w = x.shape[:-1].numel(), layer.weight
        b = next((b for b in BUCKETS if b >= M), None)
        form = self.table.get((*w.shape, b), "linear") if b else "linear"
        if form == "linear":
            return layer(x)
        if form == "transposed" and id(w) not in self.t:
            self.t[id(w)] = w.t().contiguous()
        y = FORMS[form](x.reshape(M, -1), w, self.t.get(id(w)))
        return y.reshape(*x.shape[:-1], -1)

    def to_json(self) -> str:
        return json.dumps([[*k, v] for k, v in self.table.items()])

    @classmethod
    def from_json(cls, text: str) -> "Kernels":
        return cls({tuple(row[:3]): row[3] for row in json.loads(text)})


def tuned(model) -> Kernels:
    """The model's table on this machine: tuned once, then read from the cache root."""
    from .checkpoint import atomic_write, fingerprint
    from .sources import cache_root
    from .training import hardware
    w = model.embed.weight
    key = f"{fingerprint(model)}-{hardware(w.device)}-{w.dtype}"
    path = cache_root() / "kernels" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.is_file():
        return Kernels.from_json(path.read_text())
    print(f"tuning fast mode's matrix products for this machine (once; cached in {path.parent})...",
          file=sys.stderr, flush=True)
    k = tune(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(k.to_json()))
    return k


@torch.inference_mode()
def tune(model, buckets=BUCKETS, reps: int = 2) -> Kernels:
    """Time every form for every weight shape of the model and row bucket; keep the fastest."""
    shapes = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), []).append(m.weight)
    table = {}
    for (N, K), ws in shapes.items():
        ts = [w.t().contiguous() for w in ws]
        for b in buckets:
            x = torch.randn(b, K, dtype=ws[0].dtype, device=ws[0].device)
            best = {}
            for name, f in FORMS.items():
                times = []
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    for w, wt in zip(ws, ts):
                        f(x, w, wt)
                    times.append(time.perf_counter() - t0)
                best[name] = min(times[1:])
            table[(N, K, b)] = min(best, key=best.get)
    return Kernels(table)
