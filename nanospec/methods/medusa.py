"""Medusa-1 heads (Cai et al., 2024): the base ProPD builds on (../shared/papers/propd.txt, section 2)
and the baseline BiTA and Hidden Transfer are measured against.

K heads read the base model's final (normed) hidden state h of a token x_t. The lm_head gives
x_{t+1}; head k guesses x_{t+1+k}. Head k is a residual SiLU block, h + SiLU(W_k h + b_k)
with W_k and b_k zero-initialised, then its own vocabulary projection initialised from the
lm_head, so an untrained head repeats the next-token guess. The base model is frozen.

Each step verifies a sparse static tree of head candidates with the core engine. The same
forward yields h for every tree node, and the heads on the last accepted node give the next
step's candidates, so drafting costs no extra forward.

Choices where the papers are silent, and why:
- Head k's loss is weighted 0.8^(k-1), Medusa's decay: later heads are less accurate and
  should not dominate the shared gradient scale.
- Targets are hard labels: the model's own greedy continuations (self-distillation), which
  are exactly what greedy verification accepts.
- The tree comes from measured accuracies: acc[k][r] is how often head k's rank-r candidate is
  right on held-out data. Greedy expansion adds the path with the highest product of
  accuracies whose parent is already in the tree (Medusa's sparse trees), up to tree_size nodes.
- The first step of a generation has no hidden state yet for the prompt's last token, so it
  drafts nothing (one AR step).
- On a GPU (exact mode) the forward that returns the hidden state is the engine's CUDA graph;
  the heads run eagerly after it on the last accepted row (one small matmul per head).
"""
import heapq
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import fingerprint, load_drafter_file, save_drafter
from ..data import distill_args
from ..engine import Drafter
from ..model import Block
from ..training import adamw, cosine_lr, distilled, Progress, update
from ..tree import Tree


class Heads(nn.Module):
    def __init__(self, dim: int, vocab: int, K: int):
        super().__init__()
        self.res = nn.ModuleList(nn.Linear(dim, dim) for _ in range(K))
        self.proj = nn.ModuleList(nn.Linear(dim, vocab, bias=False) for _ in range(K))

    def init_from(self, lm_head: nn.Linear) -> "Heads":
        with torch.no_grad():
            for r, p in zip(self.res, self.proj):
                r.weight.zero_()
                r.bias.zero_()
                p.weight.copy_(lm_head.weight)
        return self

    def forward(self, h):  # h (..., D) -> (K, ..., V)
        return torch.stack([p(h + F.silu(r(h))) for r, p in zip(self.res, self.proj)])


def choose_tree(acc: list[list[float]], size: int) -> list[tuple[int, ...]]:
    """Rank paths (r_1, ..., r_d), parents first: the `size` most probable under acc[k][r]."""
    K, R = len(acc), len(acc[0])
    heap = [(-acc[0][r], (r,)) for r in range(R)]
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < size:
        p, path = heapq.heappop(heap)
        paths.append(path)
        if len(path) < K:
            for r in range(R):
                heapq.heappush(heap, (p * acc[len(path)][r], path + (r,)))
    return paths


class Medusa(Drafter):
    name = "medusa"

    def __init__(self, heads: Heads, paths: list[tuple[int, ...]]):
        self.heads, self.paths = heads, [tuple(p) for p in paths]
        self.max_rows = 1 + len(self.paths)
        depth = max(map(len, self.paths))
        self.topk = [1 + max(p[d] for p in self.paths if len(p) > d) for d in range(depth)]

    def start(self, dec):
        self.cands = None

    def draft(self, dec):
        if self.cands is None:
            return Tree.chain(dec.last)
        return Tree.from_choices(dec.last, self.cands, self.paths[:max(0, dec.room - 1)])

    def forward(self, dec, tree):
        logits, self.h = dec.run(tree.block(dec.cur), hidden=True)
        return logits

    def accepted(self, dec, tree, path):
        self.cands = self.guess(self.h[path[-1]])

    def guess(self, h) -> list[list[int]]:
        """Ranked candidates per depth from the hidden state of the last accepted node."""
        logits = self.heads(h)  # (K, V)
        return [logits[d].topk(k).indices.tolist() for d, k in enumerate(self.topk)]


# --- weights on disk ---------------------------------------------------------------------------
def load_heads(model, weights):
    tensors, meta = load_drafter_file(Path(weights) / "medusa.safetensors", model, "python train.py --method medusa")
    a = model.args
    heads = Heads(a.dim, a.vocab_size, meta["heads"]).to(model.embed.weight)
    heads.load_state_dict(tensors)
    return heads.eval(), meta


def load_medusa(model, weights, tree_size=0) -> Medusa:
    heads, meta = load_heads(model, weights)
    paths = choose_tree(meta["acc"], tree_size) if tree_size else meta["tree"]
    return Medusa(heads, paths)


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    distill_args(p)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=1024, help="positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tree-size", type=int, default=24, help="draft nodes of the static tree")
    p.add_argument("--topk", type=int, default=10, help="ranks per head the tree may use")


@torch.no_grad()
def hidden_states(model, seqs: list[list[int]], layer: int | None = None, batch: int = 16) -> list[torch.Tensor]:
    """The frozen model's hidden state at every position of every sequence: the final normed one,
    or with `layer` the residual stream after that many layers (ProPD's early heads)."""
    out = []
    for i in range(0, len(seqs), batch):
        part = seqs[i:i + batch]
        T = max(map(len, part))
        blk = Block.causal(torch.tensor([s + [0] * (T - len(s)) for s in part], device=model.embed.weight.device))
        ctx = model.context(blk, T, False)  # right padding: causal, so harmless
        x = model.embed(blk.tokens)
        for L in model.layers[:layer]:
            x = L(x, ctx, None, None)
        h = model.norm(x) if layer is None else x
        out += [h[j, :len(s)] for j, s in enumerate(part)]
    return out


def samples(model, data, K: int):
    """(h_t, targets (K,)) for every position whose next token is a generated one; -100 = past the end."""
    seqs = [p + c for p, c in data]
    hs, tg = [], []
    for (p, _), seq, h in zip(data, seqs, hidden_states(model, seqs)):
        for t in range(len(p) - 1, len(seq) - 2):
            hs.append(h[t])
            tg.append([seq[t + 1 + k] if t + 1 + k < len(seq) else -100 for k in range(1, K + 1)])
    return torch.stack(hs), torch.tensor(tg)


def loss_fn(logits, targets):  # logits (K, N, V), targets (N, K)
    K = logits.shape[0]
    return sum(0.8 ** k * F.cross_entropy(logits[k], targets[:, k], ignore_index=-100) for k in range(K))


@torch.no_grad()
def accuracy(heads, h, targets, topk: int, batch: int = 4096) -> list[list[float]]:
    """acc[k][r]: fraction of positions where head k's rank-r candidate is the target."""
    hits = torch.zeros(targets.shape[1], topk)
    for i in range(0, len(h), batch):
        top = heads(h[i:i + batch]).topk(topk, dim=-1).indices  # (K, n, topk)
        hits += (top == targets[i:i + batch].T[..., None]).float().sum(1)
    valid = (targets != -100).sum(0).clamp(min=1)[:, None]
    return (hits / valid).tolist()


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)  # held out: for accuracies and the tree
    t0 = time.time()
    h_tr, y_tr = samples(model, train_data, args.heads)
    h_ev, y_ev = samples(model, held, args.heads)
    print(f"medusa: {len(h_tr):,} training positions, {len(h_ev):,} held out "
          f"(hidden states in {time.time() - t0:.0f}s)", flush=True)

    torch.manual_seed(args.seed)
    heads = Heads(model.args.dim, model.args.vocab_size, args.heads).init_from(model.lm_head)
    opt = adamw(heads, args.lr, weight_decay=0.0)
    steps = math.ceil(args.epochs * len(h_tr) / args.batch_size)
    prog = Progress(steps, every=20)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(h_tr), generator=gen)
    for step in range(steps):
        lr = cosine_lr(step, steps, args.lr, warmup=min(50, steps // 10 + 1))
        i = (step * args.batch_size) % len(h_tr)
        if i < args.batch_size and step:
            order = torch.randperm(len(h_tr), generator=gen)
        idx = order[i:i + args.batch_size]
        loss = loss_fn(heads(h_tr[idx]), y_tr[idx])
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, len(idx))

    acc = accuracy(heads, h_ev, y_ev, args.topk)
    for k, a in enumerate(acc, 1):
        print(f"head {k} (token t+{k + 1}): held-out top-1 {a[0]:.3f}, top-5 {sum(a[:5]):.3f}")
    tree = choose_tree(acc, args.tree_size)
    meta = {"base_fingerprint": fingerprint(model), "heads": args.heads, "acc": acc, "tree": tree,
            "trained": {"positions": len(h_tr), "steps": steps, "seconds": round(prog.elapsed)}}
    save_drafter(out / "medusa.safetensors", heads, meta)
    print(f"wrote {out / 'medusa.safetensors'}: {args.heads} heads, tree of {len(tree)} nodes")
