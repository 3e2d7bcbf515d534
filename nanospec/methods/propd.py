"""ProPD (Zhong et al., 2024): early tree pruning and a dynamic tree size on top of Medusa heads.

Spec: ../shared/papers/propd.txt (sections 3-4, Tables 2-3).

WORK IN PROGRESS (issue 5): this file so far holds the dynamic tree planner of section 4.2;
early pruning (4.1) and the drafter that uses both are not written yet, and nothing registers
this module as a method.

Dynamic token tree generation (4.2):
- CostModel: per (batch size, tree size), an EMA of measured iteration time; a linear fit
  T(size) = b0 + b1 * size by weighted least squares with weights exp(-lambda * age), age
  being the steps since that size was last measured (solved in closed form).
- Acceptance: per head i and rank k, an EMA of "the true token was in head i's top-k";
  p[i][k] = P[i][k] - P[i][k-1] is the chance that rank k is the right one.
- A tree's expected acceptance length is 1 (the token verification always yields) plus,
  for every node, the product of p along its path (Figure 6: 1.88 for 'abd' + 'ac').
- plan() picks the size maximising expected length / estimated time.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import RMSNorm
from ..tree import Tree
from .medusa import Medusa, choose_tree


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


def plan(p: list[list[float]], cost: CostModel, sizes: list[int], batch: int = 1) -> int:
    """The tree size maximising expected accepted length per estimated second."""
    best, best_size = -1.0, sizes[0]
    for size in sizes:
        t = cost.estimate(size + 1, batch)  # rows = draft nodes + the root
        if t is None or t <= 0:
            return sizes[0]
        v = expected_length(choose_tree(p, size), p) / t
        if v > best:
            best, best_size = v, size
    return best_size


# --- early pruning (section 4.1) ---------------------------------------------------------------

class EarlyHead(nn.Module):
    """Next-token guesses from layer-n hidden states: a zero-initialised residual SiLU block and an
    RMSNorm (from the final norm) in front of the frozen, shared lm_head (so the file stays tiny)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.res = nn.Linear(dim, dim)
        self.norm = RMSNorm(dim, eps)

    def init_from(self, model) -> "EarlyHead":
        with torch.no_grad():
            self.res.weight.zero_()
            self.res.bias.zero_()
            self.norm.weight.copy_(model.norm.weight)
        return self

    def forward(self, x, lm_head):
        return lm_head(self.norm(x + F.silu(self.res(x))))


def pruned(tree: Tree, early_logits: torch.Tensor, k: int) -> list[int]:
    """Nodes whose token is not in the top-k of their parent's early prediction (their
    descendants go with them); the root stays."""
    top = early_logits.topk(min(k, early_logits.shape[-1]), dim=-1).indices.tolist()
    return [i for i in range(1, len(tree)) if tree.tokens[i] not in top[tree.parents[i]]]


def forward_pruned(dec, tree: Tree, early: EarlyHead, layer: int, k: int):
    """The verification forward with early pruning after `layer` layers; returns (logits, h, dropped).

    Fast mode removes the pruned rows (and their descendants) before the remaining layers.
    Exact mode keeps every row (each row's result is independent of the others there) and only
    drops the pruned nodes from verification, so the survivors' logits are AR's, bitwise.
    """
    model, n = dec.model, len(tree)
    block = tree.block(dec.cur, dec.device)
    if dec.exact:
        block = block.pad(dec.Q, dec.cache.trash)
    ctx = model.context(block, dec.cache.n_slots, dec.exact)
    x = model.embed(block.tokens)
    for i in range(layer):
        x = model.layers[i](x, ctx, *dec.cache.layer(i))
    cut = pruned(tree, early(x[0, :n], model.lm_head), k)
    gone = set(cut)
    for i in range(1, n):  # descendants of a pruned node go too
        if tree.parents[i] in gone:
            gone.add(i)
    keep = torch.tensor([i for i in range(len(block)) if i not in gone], device=dec.device)
    if not dec.exact and gone:
        block = block.select(keep)
        ctx = model.context(block, dec.cache.n_slots, False)
        x = x[:, keep]
    for i in range(layer, len(model.layers)):
        x = model.layers[i](x, ctx, *dec.cache.layer(i))
    h = model.norm(x)
    out = model.lm_head(ctx.rows(h))[0]
    if not dec.exact and gone:  # scatter the survivors back to node order
        full = out.new_zeros(n, out.shape[-1])
        full_h = h.new_zeros(n, h.shape[-1])
        full[keep], full_h[keep] = out, h[0]
        out, h = full, full_h[None]
    tree.drop(cut)
    return out[:n], h[0, :n], sorted(gone)


class ProPD(Medusa):
    """Medusa's heads and tree, verified with early pruning (the dynamic size is still to come)."""
    name = "propd"

    def __init__(self, heads, paths, early: EarlyHead, layer: int, k: int):
        super().__init__(heads, paths)
        self.early, self.layer, self.k = early, layer, k
        self.rows = self.pruned_rows = 0

    def forward(self, dec, tree):
        logits, self.h, gone = forward_pruned(dec, tree, self.early, self.layer, self.k)
        self.rows += len(tree) - 1
        self.pruned_rows += len(gone)
        return logits


@torch.no_grad()
def layer_states(model, seqs: list[list[int]], layer: int, batch: int = 16) -> list[torch.Tensor]:
    """The frozen model's hidden state after `layer` layers at every position of every sequence."""
    from ..model import Block
    out = []
    for i in range(0, len(seqs), batch):
        part = seqs[i:i + batch]
        T = max(map(len, part))
        blk = Block.causal(torch.tensor([s + [0] * (T - len(s)) for s in part], device=model.embed.weight.device))
        ctx = model.context(blk, T, False)
        x = model.embed(blk.tokens)
        for L in model.layers[:layer]:
            x = L(x, ctx, None, None)
        out += [x[j, :len(s)] for j, s in enumerate(part)]
    return out


def train_early(model, data, layer: int, steps: int = 300, batch: int = 1024, lr: float = 1e-3, seed: int = 0):
    """Fit an EarlyHead at `layer` to the model's own next tokens (greedy continuations)."""
    seqs = [p + c for p, c in data]
    xs, ys = [], []
    for (p, _), s, x in zip(data, seqs, layer_states(model, seqs, layer)):
        xs.append(x[len(p) - 1:len(s) - 1])
        ys.append(torch.tensor(s[len(p):]))
    x, y = torch.cat(xs), torch.cat(ys)
    torch.manual_seed(seed)
    head = EarlyHead(model.args.dim, model.args.norm_eps).init_from(model)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        idx = torch.randint(0, len(x), (batch,))
        loss = F.cross_entropy(head(x[idx], model.lm_head), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"early head (layer {layer}): step {step + 1}/{steps} | loss {loss.item():.4f}", flush=True)
    return head
