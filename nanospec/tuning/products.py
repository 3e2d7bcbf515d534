"""Fast mode's matrix products by row count (`--kernels tuned`, the default on a CPU): each product's
fastest form on this machine, tuned once per weight shape and cached, handed to the model as the device's `forms`
(devices.Device.forms: forward.Context.linear calls it for each product of a fast forward).

A forward of a few rows on a CPU is bound by reading the weights, yet eager `F.linear` handles
a small row count almost row by row. The same product written weight-first, `(W @ x.T).T`, or
against a transposed copy of the weight, `x @ W.T`, can cost a fraction of that at a few rows.
Which wins depends on the shape, the row count and the machine, so nothing is assumed: tune()
times each form on the model's own weights (every layer of a shape, streamed, as a forward reads
them) and on the drafters' own products (a draft vocabulary's rows of the lm_head), per row bucket.
The table is cached beside the cost measurements, one file per model, machine, dtype and set of forms, with each
weight shape's rows: a shape is tuned the first time a model or drafter brings it, so a new set of methods tunes only
the shapes it adds, not the model's again.

A row count can also be slow in every form (BLAS kernels favour some widths). So a product may
run on more rows than it has, zero rows added and their results dropped, when tune() measured
the larger count faster: a forward's cost then never rises from n rows to n+1 below a bucket
edge, and the planner gets the rows it pays for (measured.measure sees the padded forward).

A fourth form, where PyTorch has oneDNN, runs against a copy of the weight packed once in oneDNN's
blocked layout: eager products repack the weight on every call, which at 8-64 rows costs as much as
the arithmetic (RESULTS.md, "Packed weights").

Fast mode's products run them (forward.Context.linear), and so do a drafter's heads in any mode (Medusa's propose:
a draft's product need not be AR's). Exact mode's model products never do: they call F.linear themselves, so AR
and every method share one kernel. Fast mode promises AR's tokens, not its bits (the benchmark counts
mismatches), and AR runs the same table.
"""
import hashlib
import json
import sys
import time

import torch
import torch.nn.functional as F

from ..io.files import atomic_write, cache_root, fingerprint, hardware

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the row counts, each with its tuned forms
FORMS = {"linear": lambda x, w, p: F.linear(x, w), "weight-first": lambda x, w, p: (w @ x.T).T,
         "transposed": lambda x, w, p: x @ p}  # x @ w.T, each the fastest somewhere; p: the weight as PREPARE made it
PREPARE = {"transposed": lambda w: w.t().contiguous()}  # forms run on a copy of the weight, made once
ONEDNN = ("_linear_pointwise", "_reorder_linear_weight")
if torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ONEDNN):  # packed weights
    FORMS["packed"] = lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    PREPARE["packed"] = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 16)  # 16: the layout's row hint

PAD_MARGIN = 0.1  # run a product on more rows only if that measured at least 10% faster


class Forms:
    """The products' forms, {(out, in, rows bucket): (form, rows)}: each one's fastest here (tune)."""

    def __init__(self, table: dict):
        self.table, self.prepared = table, {}  # prepared: (id(weight), form) -> the weight as that form wants it

    def only(self, *owners) -> "Forms":
        """The rows of the owners' product shapes alone."""
        shapes = {tuple(m.weight.shape) for m in products(*owners)}
        return Forms({k: v for k, v in self.table.items() if k[:2] in shapes})

    def __deepcopy__(self, memo):  # a copied product (a drafter copied for another run) shares the table
        return self

    def __call__(self, proj, x):
        """proj(x) in its shape's and row count's form (a product with a bias: F.linear)."""
        M, w = x.shape[:-1].numel(), proj.weight
        if proj.bias is not None:
            return F.linear(x, w, proj.bias)
        b = next((b for b in BUCKETS if b >= M), None)
        form, rows = self.table.get((*w.shape, b), ("linear", M)) if b else ("linear", M)
        if form == "linear" and rows == M:
            return F.linear(x, w)
        if form in PREPARE and (id(w), form) not in self.prepared:
            self.prepared[id(w), form] = PREPARE[form](w.detach())
        x2 = x.reshape(M, -1) if rows == M else F.pad(x.reshape(M, -1), (0, 0, 0, rows - M))  # zero rows added
        # row-major out, as F.linear's: later products on a weight-first result's layout run slower
        y = FORMS[form](x2, w, self.prepared.get((id(w), form)))[:M].contiguous()
        return y.reshape(*x.shape[:-1], -1)


def products(*owners) -> list[torch.nn.Linear]:
    """The bias-free products (nn.Linear) of owners (a model; a drafter: its modules, e.g. its heads)."""
    modules = [m for o in owners for m in ([o] if isinstance(o, torch.nn.Module) else
                                            [v for v in vars(o).values() if isinstance(v, torch.nn.Module)])]
    return [m for module in modules for m in module.modules() if isinstance(m, torch.nn.Linear) and m.bias is None]


def to_json(k: Forms) -> str:
    """The table as {"NxK": [[bucket, form, rows], ...]}, sorted: one table, one text (measured.measure hashes it)."""
    shapes = {}
    for (N, K, b), v in sorted(k.table.items()):
        shapes.setdefault(f"{N}x{K}", []).append([b, *v])
    return json.dumps(shapes)


def from_json(text: str) -> Forms:
    return Forms({(*map(int, s.split("x")), b): (form, rows)
                    for s, rs in json.loads(text).items() for b, form, rows in rs})


def tuned(model, *drafters) -> Forms:
    """The table of the model's and drafters' products on this machine, read from the cache root; a shape the cache
    lacks is tuned and added. Two processes may write at once: each write is whole (atomic_write), and a shape the
    other one added meanwhile may be lost, to be tuned again next time."""
    w = model.embed.weight
    key = f"{fingerprint(model)}-{hardware(w.device)}-{w.dtype}-{'-'.join(sorted(FORMS))}"
    path = cache_root() / "forms" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    read = lambda: from_json(path.read_text()).table if path.is_file() else {}
    table, mine = read(), products(model, *drafters)
    known = {k[:2] for k in table}
    missing = [m for m in mine if tuple(m.weight.shape) not in known]  # every layer of a new shape: tune streams them
    if missing:
        print(f"tuning fast mode's matrix products for this machine (once per shape; cached in {path.parent})...",
              file=sys.stderr, flush=True)
        table = {**read(), **tune(*missing).table}  # read again: shapes another process added since
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda p: p.write_text(to_json(Forms(table))))
    return Forms(table).only(model, *drafters)  # only these: measured.measure keys by the model's


@torch.inference_mode()
def tune(*owners, buckets=BUCKETS, reps: int = 4) -> Forms:
    """Time every form for every weight shape of the owners' products (a model's, drafters') and row bucket;
    each bucket keeps the fastest (form, rows) of its own and the larger buckets up to twice its rows."""
    shapes = {}
    for m in products(*owners):
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
    return Forms(table)
