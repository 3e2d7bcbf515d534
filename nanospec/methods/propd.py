"""ProPD (Zhong et al., 2024): early tree pruning and a dynamic tree size on top of Medusa heads.

Spec: ../shared/papers/propd.txt (sections 3-4, Tables 2-3). Medusa (medusa.py) supplies the
heads and the candidate tree; this file adds what is ProPD's own.

Early pruning (4.1): an early prediction head reads the residual stream after layer n. In the
verification forward, after layer n, every tree node whose token is not in the top-k of its
parent's early prediction is pruned with its descendants, and layers n+1.. run on the
survivors only: rows removed in fast mode (the attention context is sliced, not rebuilt: the
paper's cached masks), kept but dropped from verification in exact mode (there a row's result
never depends on the other rows, so survivors' logits stay AR's, bitwise).

Dynamic token tree generation (4.2):
- CostModel: per (batch size, tree size), an EMA of measured iteration time; a linear fit
  T(size) = b0 + b1 * size by weighted least squares with weights exp(-lambda * age), age
  being the steps since that size was last measured (solved in closed form).
- Acceptance: per head i and rank k, an EMA of "the true token was in head i's top-k";
  p[i][k] = P[i][k] - P[i][k-1] is the chance that rank k is the right one.
- A tree's expected acceptance length is 1 (the token verification always yields) plus,
  for every node, the product of p along its path (Figure 6: 1.88 for 'abd' + 'ac').
- plan() picks the size maximising expected length / estimated time; the tree of that size is
  Medusa's greedy expansion under the tracked p.

Choices where the paper is silent, and why:
- The early head is a zero-initialised residual SiLU block, an RMSNorm (from the final norm)
  and a rank-64 vocabulary projection initialised from the lm_head's truncated SVD. The paper
  trains "their own heads" for early layers (Figure 3a) and only needs them to rule tokens out
  (top-k, not top-1). A full-rank projection would cost as much as the lm_head, a third of
  this small model's layer weights, on every step; at batch size 1 on CPU that ate the whole
  saving. Rank 64 is 4x cheaper and, trained, more accurate than the frozen lm_head was.
  The heads are fitted to the base model's own next token (self-distillation data) at every
  layer of --early-layers, by `train.py --method medusa` (after the Medusa heads) or alone by
  `train.py --method propd`.
- Iteration time is wall time from one draft to the next (forward, verification, commit and
  drafting included), keyed by the tree's size before pruning: pruning shows up as cheaper
  large trees, which is how the two techniques combine (section 5.4.3).
- Candidate sizes 1-64. Until two sizes have been measured the planner explores: the static
  tree's size, then the smallest. Every generation's first step is a one-row AR step (no hidden
  state yet); it is not timed, since a single row takes a faster matrix-vector path on CPU and
  would bend the line.
- Acceptance starts from the heads' measured held-out accuracies (stored by the trainer) and
  tracks the top 10 ranks per head; a prediction is resolved once its position is emitted.
- The plan is redone when the sequence length has moved by `replan` tokens (default 32) since
  the last plan and at the start of every generation; the cost model and acceptance EMAs
  persist across generations (the decoding conditions they estimate do).
- On a GPU (exact mode) the whole verification forward, early head included, is one CUDA graph
  per early layer; pruning is decided on the host from its logits, after the replay. Fast mode
  prunes mid-forward, eagerly (its row count changes, so it has no fixed shape to capture).
"""
import functools
import math
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..checkpoint import fingerprint, load_drafter_file, save_drafter
from ..model import Block, RMSNorm
from ..training import adamw, cosine_lr, distilled, Progress, update
from ..tree import Tree, _layout
from .medusa import Medusa, choose_tree, hidden_states, load_heads

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


class CostModel:
    def __init__(self, alpha: float = 0.3, lam: float = 0.01):
        self.alpha, self.lam = alpha, lam
        self.perf: dict[tuple[int, int], float] = {}  # (batch, size) -> EMA of iteration time
        self.seen: dict[tuple[int, int], int] = {}    # (batch, size) -> step of the last update
        self.step = 0

    def update(self, size: int, seconds: float, batch: int = 1) -> None:
        key = (batch, size)
        old = self.perf.get(key)
        self.perf[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self.seen[key] = self.step
        self.step += 1

    def fit(self, batch: int = 1) -> tuple[float, float] | None:
        """(b0, b1) of the weighted least-squares line, or None with fewer than two sizes measured."""
        pts = [(s, t, math.exp(-self.lam * (self.step - self.seen[(b, s)])))
               for (b, s), t in self.perf.items() if b == batch]
        if len({s for s, _, _ in pts}) < 2:
            return None
        W = sum(w for _, _, w in pts)
        xm = sum(w * s for s, _, w in pts) / W
        ym = sum(w * t for _, t, w in pts) / W
        b1 = sum(w * (s - xm) * (t - ym) for s, t, w in pts) / sum(w * (s - xm) ** 2 for s, _, w in pts)
        return ym - b1 * xm, b1

    def estimate(self, size: int, batch: int = 1) -> float | None:
        fit = self.fit(batch)
        return None if fit is None else fit[0] + fit[1] * size


class FixedCost(CostModel):
    """A cost model that does not learn: T(size) = b0 + b1 * size, so plans do not depend on
    wall-clock timings (tests; reproducible runs)."""

    def __init__(self, b0: float, b1: float):
        super().__init__()
        self.line = (b0, b1)

    def update(self, size: int, seconds: float, batch: int = 1) -> None:
        pass

    def fit(self, batch: int = 1) -> tuple[float, float]:
        return self.line


class Acceptance:
    """P[i][k]: EMA of "head i's true token was in its top-(k+1)"."""

    def __init__(self, heads: int, topk: int, alpha: float = 0.05, prior: list[list[float]] | None = None):
        self.alpha = alpha
        self.P = [list(row) for row in prior] if prior else [[0.0] * topk for _ in range(heads)]

    def update(self, head: int, rank: int | None) -> None:
        """rank: where the true token was in the head's ranking (None: beyond top-k)."""
        row = self.P[head]
        for k in range(len(row)):
            row[k] = (1 - self.alpha) * row[k] + self.alpha * (rank is not None and rank <= k)

    def p(self) -> list[list[float]]:
        return [[row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))] for row in self.P]


def expected_length(paths: list[tuple[int, ...]], p: list[list[float]]) -> float:
    total = 1.0
    for path in paths:
        total += math.prod(p[d][r] for d, r in enumerate(path))
    return total


def plan(p: list[list[float]], cost: CostModel, sizes, batch: int = 1) -> int | None:
    """The tree size maximising expected accepted length per estimated second (None: no fit yet)."""
    fit = cost.fit(batch)
    if fit is None:
        return None
    speed = {s: expected_length(choose_tree(p, s), p) / max(fit[0] + fit[1] * s, 1e-9) for s in sizes}
    return max(sizes, key=speed.get)


# --- early pruning (section 4.1) ---------------------------------------------------------------

class EarlyHead(nn.Module):
    """Next-token guesses from the residual stream after layer n (see the header): a residual SiLU
    block and an RMSNorm, then a rank-r vocabulary projection (up @ down) initialised from the
    truncated SVD of the lm_head, so an untrained head is the logit lens through a low-rank lm_head."""

    def __init__(self, dim: int, vocab: int, rank: int, eps: float):
        super().__init__()
        self.res = nn.Linear(dim, dim)
        self.norm = RMSNorm(dim, eps)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, vocab, bias=False)

    def init_from(self, model) -> "EarlyHead":
        U, S, Vh = torch.linalg.svd(model.lm_head.weight.float(), full_matrices=False)
        r = self.down.out_features
        with torch.no_grad():
            self.res.weight.zero_()
            self.res.bias.zero_()
            self.norm.weight.copy_(model.norm.weight)
            self.down.weight.copy_(Vh[:r])
            self.up.weight.copy_(U[:, :r] * S[:r])
        return self

    def forward(self, x):
        return self.up(self.down(self.norm(x + F.silu(self.res(x)))))


def pruned(tree: Tree, x: torch.Tensor, early: EarlyHead, k: int) -> torch.Tensor:
    """(n,) bool: nodes to prune given the rows' layer-n states x (n, D). A node goes when its
    token is not in the top-k of its parent's early prediction, or when an ancestor goes."""
    par, row, path = _shape(tuple(tree.parents), x.device)
    logits = early(x[par])
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # (parents, k)
    tok = torch.tensor(tree.tokens, device=x.device)
    bad = ~(top[row] == tok[:, None]).any(-1)
    bad[0] = False  # the root is never a draft
    return (bad[path.clamp(min=0)] & (path >= 0)).any(-1)


@functools.lru_cache(maxsize=64)
def _shape(parents: tuple[int, ...], device):
    """For a tree shape: the nodes that have children, each node's parent's row among them,
    and each node's path from the root (-1 padded), as tensors."""
    par = sorted(set(parents[1:])) or [0]
    row = [par.index(p) if p >= 0 else 0 for p in parents]
    path = _layout(parents)[0][0]
    return (torch.tensor(par, device=device), torch.tensor(row, device=device), path.to(device))


def forward_pruned(dec, tree: Tree, early: EarlyHead, layer: int, k: int):
    """The verification forward with early pruning after `layer` layers: (logits (n, V), h (n, D),
    pruned nodes). Pruned rows' logits and states are zeros in fast mode; never read."""
    model, n, cache = dec.model, len(tree), dec.cache

    def run(ctx, x, layers):
        for i in layers:
            x = model.layers[i](x, ctx, *cache.layer(i))
        return x

    def head(ctx, x):
        h = model.norm(x[0])
        return model.lm_head(ctx.rows(h)), h

    if dec.exact:  # every row runs every layer, captured as one CUDA graph on a GPU; pruned nodes only leave verification
        def full(*b):
            block = Block(*b)
            ctx = model.context(block, cache.n_slots, True)
            x = run(ctx, model.embed(block.tokens), range(layer))
            return *head(ctx, run(ctx, x, range(layer, len(model.layers)))), x[0]
        logits, h, x = dec.graphed(("propd", layer), full, *dec.fixed(tree.block(dec.cur)))
        gone = pruned(tree, x[:n], early, k).nonzero()[:, 0].tolist()
    else:  # pruned rows are removed after layer `layer`
        block = tree.block(dec.cur, dec.device)
        ctx = model.context(block, cache.n_slots, False)
        x = run(ctx, model.embed(block.tokens), range(layer))
        cut = pruned(tree, x[0], early, k)
        gone = cut.nonzero()[:, 0].tolist()
        keep = (~cut).nonzero()[:, 0]
        if gone:
            ctx, x = ctx.select(keep), x[:, keep]
        logits, h = head(ctx, run(ctx, x, range(layer, len(model.layers))))
        if gone:  # scatter the survivors back to node order
            logits = logits.new_zeros(n, logits.shape[-1]).index_copy_(0, keep, logits)
            h = h.new_zeros(n, h.shape[-1]).index_copy_(0, keep, h)
    tree.drop(gone)
    return logits[:n], h[:n], gone


# --- the drafter ---------------------------------------------------------------------------------

class ProPD(Medusa):
    """Medusa's heads, verified with early pruning (early=None: off) and a dynamic tree size
    (dynamic=False: Medusa's static tree `paths`)."""
    name = "propd"

    def __init__(self, heads, paths, acc, early: EarlyHead | None = None, layer: int = 2, k: int = 10,
                 dynamic: bool = True, sizes=SIZES, replan: int = 32, alpha: float = 0.3, lam: float = 0.01,
                 cost: CostModel | None = None):
        super().__init__(heads, paths)
        self.early, self.layer, self.k = early, layer, k
        self.dynamic, self.sizes, self.replan = dynamic, sorted(sizes), replan
        self.static = list(self.paths)
        if dynamic:  # room for the largest tree; candidates for every tracked rank
            self.max_rows = 1 + max(self.sizes)
            self.topk = [len(acc[0])] * len(acc)
        self.accept = Acceptance(len(acc), len(acc[0]), alpha=0.05,
                                 prior=[[sum(row[:r + 1]) for r in range(len(row))] for row in acc])
        self.cost = cost or CostModel(alpha, lam)
        self.rows = self.pruned_rows = 0
        self.sizes_used = Counter()  # planned size -> steps

    def start(self, dec):
        super().start(dec)
        self.pending = []      # (output index, head, ranked candidates) awaiting the true token
        self.timer = None      # (tree size, start time) of the step in flight
        self.planned_at = None

    def draft(self, dec):
        now = time.perf_counter()
        if self.timer is not None:
            self.cost.update(self.timer[0], now - self.timer[1])
        if self.dynamic and (self.planned_at is None or abs(dec.cur - self.planned_at) >= self.replan):
            p = self.accept.p()
            size = plan(p, self.cost, self.sizes)
            if size is None:  # explore: measure the static tree's size, then the smallest
                seen = {s for _, s in self.cost.perf}
                size = next((s for s in (len(self.static), self.sizes[0]) if s not in seen), len(self.static))
            else:
                self.planned_at = dec.cur
            self.paths = choose_tree(p, size)
        tree = super().draft(dec)
        # time full trees only: not the first step (no hidden state yet: one AR row) nor trees cut by the cache
        self.timer = (len(self.paths), now) if self.cands is not None and len(tree) - 1 == len(self.paths) else None
        self.sizes_used[len(tree) - 1] += 1
        return tree

    def forward(self, dec, tree):
        if self.early is None or len(tree) == 1:
            return super().forward(dec, tree)
        logits, self.h, gone = forward_pruned(dec, tree, self.early, self.layer, self.k)
        self.rows += len(tree) - 1
        self.pruned_rows += len(gone)
        return logits

    def accepted(self, dec, tree, path):
        super().accepted(dec, tree, path)
        if not self.dynamic:
            return
        n, out = len(dec.out), dec.out
        for i, head, cands in self.pending:
            if i < n:
                self.accept.update(head, cands.index(out[i]) if out[i] in cands else None)
        self.pending = [q for q in self.pending if q[0] >= n]
        self.pending += [(n + d, d, c) for d, c in enumerate(self.cands)]  # head d guesses output n + d

    def report(self) -> str:
        parts = []
        if self.early is not None:
            parts.append(f"pruned {self.pruned_rows}/{self.rows} draft rows "
                         f"({100 * self.pruned_rows / max(self.rows, 1):.1f}%) after layer {self.layer}, top-{self.k}")
        total = sum(self.sizes_used.values())
        top = sorted(self.sizes_used.items(), key=lambda kv: -kv[1])[:4]
        parts.append("tree sizes " + ", ".join(f"{s} ({100 * c / total:.0f}%)" for s, c in top))
        return "; ".join(parts)


# --- weights on disk ---------------------------------------------------------------------------
TRAIN_CMD = "python train.py --method propd"


def load_early(model, weights, layer: int) -> EarlyHead:
    tensors, meta = load_drafter_file(Path(weights) / "propd.safetensors", model, TRAIN_CMD)
    if layer not in meta["layers"]:
        raise NanospecError(f"propd.safetensors has early heads for layers {meta['layers']}, not {layer}; "
                            f"train it with `{TRAIN_CMD} --early-layers {layer}`")
    a = model.args
    head = EarlyHead(a.dim, a.vocab_size, meta["rank"], a.norm_eps).to(model.embed.weight)
    head.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"layer{layer}.")})
    return head.eval()


def load_propd(model, weights, layer=2, k=10, prune=True, dynamic=True, tree_size=0, replan=32) -> ProPD:
    heads, meta = load_heads(model, weights)
    early = load_early(model, weights, layer) if prune else None
    paths = choose_tree(meta["acc"], tree_size) if tree_size else meta["tree"]
    return ProPD(heads, paths, meta["acc"], early, layer, k, dynamic, replan=replan)


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    p.add_argument("--early-layers", default="2,4,6", help="layers to train early heads after (comma-separated)")
    p.add_argument("--early-steps", type=int, default=400)
    p.add_argument("--early-rank", type=int, default=64, help="rank of the early heads' vocabulary projection")
    p.add_argument("--early-batch", type=int, default=1024, help="positions per step")
    p.add_argument("--early-lr", type=float, default=2e-3)


def samples(model, data, layer: int, ahead: int = 1):
    """(layer-n state at t, the model's token t+ahead) for every position t from the prompt's
    last token on whose token t+ahead is in the sequence."""
    seqs = [p + c for p, c in data]
    xs, ys = [], []
    for (p, _), s, x in zip(data, seqs, hidden_states(model, seqs, layer)):
        xs.append(x[len(p) - 1:len(s) - ahead])
        ys.append(torch.tensor(s[len(p) - 1 + ahead:]))
    return torch.cat(xs), torch.cat(ys)


@torch.no_grad()
def topk_hits(head, x, y, ks, batch: int = 4096) -> dict[int, float]:
    """How often the true next token is in the head's top-k, per k."""
    hits = Counter()
    for i in range(0, len(x), batch):
        rank = head(x[i:i + batch]).topk(max(ks), dim=-1).indices == y[i:i + batch, None]
        for k in ks:
            hits[k] += int(rank[:, :k].any(-1).sum())
    return {k: hits[k] / len(x) for k in ks}


def train_early(model, data, layer: int, steps: int, rank: int = 64, batch: int = 1024, lr: float = 2e-3,
                seed: int = 0, ahead: int = 1) -> EarlyHead:
    """Fit an early head after `layer` to the model's own tokens `ahead` positions on (1: the next
    token, ProPD's; more: Hidden Transfer's early-exit baseline); the model stays frozen."""
    print(f"early head after layer {layer} for token t+{ahead}: {steps} steps", flush=True)
    x, y = samples(model, data, layer, ahead)
    torch.manual_seed(seed)
    a = model.args
    head = EarlyHead(a.dim, a.vocab_size, rank, a.norm_eps).init_from(model).to(x)
    opt = adamw(head, lr, weight_decay=0.0)
    prog = Progress(steps, every=50)
    gen = torch.Generator().manual_seed(seed + layer)
    for step in range(steps):
        lr_now = cosine_lr(step, steps, lr, warmup=min(20, steps // 10 + 1))
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        loss = F.cross_entropy(head(x[idx]), y[idx])
        update(opt, loss, lr_now, clip=None)
        prog.step(step, loss.item(), lr_now, len(idx))
    return head


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)
    layers = sorted({int(v) for v in args.early_layers.split(",")})
    if not all(1 <= n < model.args.n_layers for n in layers):
        raise NanospecError(f"--early-layers must lie in 1..{model.args.n_layers - 1}")
    heads, hits = nn.ModuleDict(), {}
    for n in layers:
        heads[f"layer{n}"] = train_early(model, train_data, n, args.early_steps, args.early_rank, args.early_batch,
                                          args.early_lr, args.seed)
        hits[n] = topk_hits(heads[f"layer{n}"], *samples(model, held, n), ks=(1, 5, 10, 20, 50, 100))
        print(f"early head after layer {n}: held-out next token in top-k: "
              + ", ".join(f"top-{k} {v:.3f}" for k, v in hits[n].items()), flush=True)
    meta = {"base_fingerprint": fingerprint(model), "layers": layers, "rank": args.early_rank, "topk_hits": hits}
    save_drafter(out / "propd.safetensors", heads, meta)
    print(f"wrote {out / 'propd.safetensors'}: early heads after layers {layers}")
