"""Hidden Transfer (Wu et al., 2024): forged hidden states of future tokens in middle layers.

Spec: ../shared/papers/hidden_transfer.txt (sections 3.2-3.4, 4.4-4.5, Figures 2-7).

k transfer steps. Step i is a d x d linear map W_i at layer t_i (t_1 < t_2 < ...): the
residual state of a real token x_p after t_i layers, mapped by W_i, becomes a pseudo hidden
state of the token p+i. It runs through the remaining layers at position p+i, attending to
the context, to the token's tree path and to the earlier pseudo states of its own chain (the
serialized prediction the paper argues for), and the original norm + lm_head decode it: pseudo
state i predicts the token at p+i+1, the depth-i draft. The base model is frozen.

Each step runs one forward: the tree (verified exactly as AR would) plus a group of k pseudo
rows on every tree node, so the group of the last accepted node drafts the next tree (Figure
2). No tree row sees a pseudo row. Fast mode adds pseudo rows at their layer (no compute below
it); exact mode runs them as placeholder rows through every layer and overwrites them at t_i.

Choices where the paper is silent, and why:
- "Layer t" is the residual stream after t layers; W_i is initialised to the identity (the copy
  mechanism the paper starts from), with no bias.
- Loss: KL(P || P~) with the base model's distribution P at the pseudo state's position as the
  target, averaged over positions, summed over steps. Positions: every token of the answer
  part of the self-distillation data (where drafting happens), as hosts.
- Training attention (`--attention`): `paper` (default; section 3.3: pseudo state of step i on
  host j sees real tokens up to j+i-1 and itself), `chain` (what decoding sees: real tokens up
  to j, the earlier pseudo states of its chain, itself) or `masked` (real tokens up to j and
  itself: Figure 7's ablation). Under `paper` and `masked` the steps never see each other, so
  training them together in one forward is training them separately: the gradient of W_i
  comes from step i alone, AdamW is per parameter and the gradient is clipped per W_i.
- Layers (5, 6, 7) of the default model's 8, from the sweep of Figures 5-6 (80-step runs,
  README): step 1 alone at layers 1-6 is flat from 2 to 5 (held-out top-1 0.71-0.73) and lower
  at 1 and 6; step 2 over t_1 = 4 is flat from 5 to 7; (5, 6, 7) matches (4, 5, 6) and costs
  least, since a pseudo row runs only the layers from its own. lr 3e-3 (1e-3 learns slower in
  80 steps; 1e-2 is no better).
- The tree is Medusa's (saved in medusa.safetensors' metadata) for the paper's comparison at
  the same tree; `tree_size=N` builds one from Hidden Transfer's own held-out accuracies.
- The first step has no pseudo states yet: it is the root and its group (one AR step that
  already drafts).
- On a GPU (exact mode) the layer loop that forges pseudo rows is one CUDA graph per tree size
  (its index tensors depend on that size alone); fast mode runs it eagerly.
"""
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..checkpoint import fingerprint, load_drafter_file, save_drafter
from ..data import distill_args
from ..engine import Drafter
from ..model import Block, Context
from ..training import adamw, cosine_lr, distilled, Progress, update
from ..tree import Tree, group_rows
from .medusa import choose_tree

ATTENTION = ("paper", "chain", "masked")


class Transfer(nn.Module):
    """The k maps W_i and the layers t_i they act at."""

    def __init__(self, dim: int, layers: list[int]):
        super().__init__()
        if list(layers) != sorted(set(layers)):
            raise NanospecError(f"hidden_transfer layers {layers}: need t_1 < t_2 < ...")
        self.layers = list(layers)
        self.W = nn.ParameterList(nn.Parameter(torch.eye(dim)) for _ in layers)

    @property
    def k(self) -> int:
        return len(self.layers)

    def check(self, n_layers: int):
        if not 1 <= self.layers[0] or self.layers[-1] >= n_layers:
            raise NanospecError(f"hidden_transfer layers {self.layers}: each must be in 1..{n_layers - 1}")
        return self


def transfer_layers(model, tr: Transfer, ctx: Context, x, hosts, rows, kv, join: bool, record=None):
    """Run the layers over real and pseudo rows; returns the final normed states (B, R, D).

    x (B, R, D): the rows' inputs, real rows first (pseudo rows' inputs are placeholders).
    hosts (B, H): real rows; rows[i] (H,): the step-i pseudo rows, made from the hosts.
    kv(L): layer L's key/value buffers. join: pseudo rows enter at their layer (fast mode and
    training); otherwise all rows run every layer and pseudo rows are overwritten (exact mode).
    record: a list that receives the states after 0, 1, ..., L layers (full row order; pseudo
    rows from their own layer on, as made by W_i there).
    """
    R = x.shape[1]
    active, c = torch.arange(R, device=x.device), ctx
    if join:  # the real rows come first, so host indices hold in the shortened x too
        keep = torch.ones(R, dtype=torch.bool, device=x.device)
        keep[torch.cat(rows)] = False
        active = keep.nonzero()[:, 0]
        x, c = x[:, active], ctx.select(active)
    full = lambda y: y.new_zeros(y.shape[0], R, y.shape[-1]).index_copy(1, active, y) if join else y
    idx = hosts[..., None].expand(-1, -1, x.shape[-1])
    for L, layer in enumerate(model.layers):
        for i, t in enumerate(tr.layers):
            if t == L:
                new = F.linear(x.gather(1, idx), tr.W[i].to(x.dtype))
                if join:
                    x, active = torch.cat([x, new], 1), torch.cat([active, rows[i]])
                    c = ctx.select(active)
                else:
                    x = x.index_copy(1, rows[i], new)
        if record is not None:
            record.append(full(x))
        x = layer(x, c, *kv(L))
    if record is not None:
        record.append(full(x))
    return full(model.norm(x))


# --- decoding ----------------------------------------------------------------------------------

class HiddenTransfer(Drafter):
    name = "hidden_transfer"

    def __init__(self, tr: Transfer, paths: list[tuple[int, ...]], chained: bool = True):
        self.tr, self.paths, self.chained = tr, [tuple(p) for p in paths], chained
        if max(map(len, self.paths)) > tr.k:
            raise NanospecError(f"the tree is {max(map(len, self.paths))} deep but there are {tr.k} transfer steps")
        self.max_rows = (1 + len(self.paths)) * (1 + tr.k)
        self.topk = [1 + max((p[d] for p in self.paths if len(p) > d), default=0) for d in range(tr.k)]

    def start(self, dec):
        self.cands = None

    def draft(self, dec):
        if self.cands is None:
            return Tree.chain(dec.last)
        room = dec.room // (1 + self.tr.k) - 1  # nodes that fit with their groups
        return Tree.from_choices(dec.last, self.cands, self.paths[:max(0, room)])

    def forward(self, dec, tree):
        model, n, k = dec.model, len(tree), self.tr.k
        blk = tree.block(dec.cur)
        if n * (1 + k) > dec.room:  # no room for pseudo rows: verify alone, draft nothing next
            self.pseudo = None
            return dec.run(blk)
        full = Block.cat(blk, group_rows(blk, list(range(n)), k, dec.cur + n, chained=self.chained))
        rows = [n + torch.arange(n, device=dec.device) * k + i for i in range(k)]
        hosts = torch.arange(n, device=dec.device)[None]
        cache, exact = dec.cache, dec.exact

        def layers(full):  # (final states, logits); exact: all rows, AR's GEMM shape
            ctx = model.context(full, cache.n_slots, exact)
            h = transfer_layers(model, self.tr, ctx, model.embed(full.tokens), hosts, rows, cache.layer, not exact)
            return h, model.lm_head(ctx.rows(h[0]) if exact else h[0, :n])

        if exact:  # a CUDA graph per tree size on a GPU (the index tensors above depend on n alone)
            h, logits = dec.graphed(("hidden_transfer", self.tr, n), lambda *b: layers(Block(*b)), *dec.fixed(full))
        else:
            h, logits = layers(full.to(dec.device))
        self.pseudo = h[0, n:n * (1 + k)].view(n, k, -1)  # normed; decoded once the last node is known
        return logits[:n]

    def accepted(self, dec, tree, path):
        if self.pseudo is None:
            self.cands = None
            return
        top = dec.model.lm_head(self.pseudo[path[-1]])  # (k, V): the last accepted node's pseudo states
        self.cands = [top[d].topk(r).indices.tolist() for d, r in enumerate(self.topk)]


# --- weights on disk ---------------------------------------------------------------------------
def load_transfer(model, weights):
    tensors, meta = load_drafter_file(Path(weights) / "hidden_transfer.safetensors", model,
                                      "python train.py --method hidden_transfer")
    tr = Transfer(model.args.dim, meta["layers"]).check(model.args.n_layers)
    tr.load_state_dict(tensors)
    return tr.to(model.embed.weight).eval(), meta


def load_hidden_transfer(model, weights, tree_size=0, chained=True) -> HiddenTransfer:
    tr, meta = load_transfer(model, weights)
    if tree_size:
        paths = choose_tree(meta["acc"], tree_size)
    else:  # Medusa's tree, as the paper compares them
        medusa = Path(weights) / "medusa.safetensors"
        paths = load_drafter_file(medusa, model, "python train.py --method medusa")[1]["tree"] \
            if medusa.is_file() else meta["tree"]
    return HiddenTransfer(tr, [p for p in paths if len(p) <= tr.k], chained)


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    distill_args(p)
    p.add_argument("--layers", default="5,6,7", help="t_1,t_2,...: the layer of each transfer step")
    p.add_argument("--attention", default="paper", choices=ATTENTION, help="pseudo rows' view in training")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tree-size", type=int, default=24, help="nodes of the tree saved from the accuracies")
    p.add_argument("--topk", type=int, default=10, help="ranks measured per step")
    p.add_argument("--analyze", action="store_true", help="Figures 3, 4, 7 for the trained maps; trains nothing "
                   "but the early-exit baseline")
    p.add_argument("--early-steps", type=int, default=400, help="--analyze: early-exit head training steps (0: skip)")
    p.add_argument("--early-rank", type=int, default=64, help="--analyze: early-exit head rank")


def pack(seqs: list[list[int]], starts: list[int], k: int, attention: str):
    """A packed batch: T real rows, then k blocks of H pseudo rows (step i, host j = start-1+h,
    one per answer token). Returns (tokens, pos, vis (B, R, R), hosts (B, H), valid (B, k, H),
    teacher (B, k, H): the real row whose distribution pseudo row (i, h) learns, label (B, k, H):
    the token after it, -100 past the end)."""
    T = max(map(len, seqs))
    H = max(len(s) - st + 1 for s, st in zip(seqs, starts))
    R = T + k * H
    out = []
    t, i, h = torch.arange(T), torch.arange(k)[:, None], torch.arange(H)[None]
    for s, st in zip(seqs, starts):
        j = (st - 1 + h).expand(k, H)                 # host rows (k, H)
        target = j + 1 + i                             # the token the pseudo state stands for
        valid = target <= len(s) - 1                   # its real row exists (and so its P)
        vis = torch.zeros(R, R, dtype=torch.bool)
        vis[:T, :T] = t[None] <= t[:, None]
        real_to = {"paper": target - 1, "chain": j, "masked": j}[attention]  # last real row seen
        me = T + i * H + h                              # (k, H) pseudo row indices
        vis[me.flatten()[:, None], t[None]] = (t[None] <= real_to.flatten()[:, None])
        vis[me.flatten(), me.flatten()] = True
        if attention == "chain":                       # and the earlier steps of its chain
            for a in range(k):
                for b in range(a):
                    vis[me[a], me[b]] = True
        label = torch.tensor(s + [-100] * (T + 2 - len(s)))[(target + 1).clamp(max=T + 1)]
        out.append((torch.tensor(s + [0] * (R - len(s))), torch.cat([t, target.flatten()]), vis,
                    j[0].clamp(max=T - 1), valid, target.clamp(max=T - 1), label))
    return tuple(torch.stack(x) for x in zip(*out))


def pseudo_states(model, tr: Transfer, tokens, pos, vis, hosts, record=None):
    """Final normed states (B, R, D) of a packed batch: cache-free, the model frozen."""
    (B, R), a = tokens.shape, model.args
    H = hosts.shape[1]
    T = R - tr.k * H
    ctx = Context(*model.rope(pos), torch.arange(R, device=tokens.device), False, mask=vis, L=R)
    w = model.embed.weight
    kv = lambda L: (w.new_zeros(B, a.kv_heads, R, a.hd), w.new_zeros(B, a.kv_heads, R, a.hd))
    rows = [T + i * H + torch.arange(H) for i in range(tr.k)]
    return transfer_layers(model, tr, ctx, model.embed(tokens), hosts, rows, kv, True, record)


def kl_loss(model, h, valid, teacher):
    """Section 3.3: KL(P || P~) per pseudo row, P the base model's distribution at the real row
    of the token the pseudo state stands for. Returns (sum over steps, per-step means)."""
    (B, k, H), D = valid.shape, h.shape[-1]
    T = h.shape[1] - k * H
    with torch.no_grad():
        real = h[:, :T].gather(1, teacher.view(B, k * H, 1).expand(-1, -1, D))
        logp = F.log_softmax(model.lm_head(real).float(), -1)
    logq = F.log_softmax(model.lm_head(h[:, T:]).float(), -1)
    kl = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1).view(B, k, H)
    per_step = (kl * valid).sum((0, 2)) / valid.sum((0, 2)).clamp(min=1)
    return per_step.sum(), per_step


def batches(data, k, attention, batch_size, seed, steps):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch_size,), generator=gen).tolist()
        yield pack([data[i][0] + data[i][1] for i in idx], [len(data[i][0]) for i in idx], k, attention)


def ordered(data, k, attention, batch_size):
    """Every sequence of data once, in order: held-out evaluation."""
    for i in range(0, len(data), batch_size):
        part = data[i:i + batch_size]
        yield pack([p + c for p, c in part], [len(p) for p, _ in part], k, attention)


@torch.no_grad()
def accuracy(model, tr, data, attention="chain", topk=10, batch_size=8):
    """acc[i][r]: how often step i's rank-r candidate is the model's greedy token on held-out
    sequences, by default with the attention decoding uses (chain)."""
    hits, count = torch.zeros(tr.k, topk), torch.zeros(tr.k)
    for tokens, pos, vis, hosts, valid, teacher, label in ordered(data, tr.k, attention, batch_size):
        (B, k, H), T = label.shape, tokens.shape[1] - tr.k * label.shape[2]
        h = pseudo_states(model, tr, tokens, pos, vis, hosts)
        top = model.lm_head(h[:, T:]).topk(topk, -1).indices.view(B, k, H, topk)
        ok = label != -100
        hits += ((top == label[..., None]) & ok[..., None]).sum((0, 2)).float()
        count += ok.sum((0, 2)).float()
    return (hits / count.clamp(min=1)[:, None]).tolist()


@torch.no_grad()
def similarity(model, tr, data, batch_size=8):
    """Figure 4: mean cosine similarity of each step's pseudo state to the real state of the
    token it stands for, after n = t_i..L layers (None below t_i) and after the final norm.
    Returns sims[n][step], n = 0..L, then the final norm's row."""
    L = len(model.layers)
    total, count = torch.zeros(L + 2, tr.k), torch.zeros(tr.k)
    for tokens, pos, vis, hosts, valid, teacher, _ in ordered(data, tr.k, "chain", batch_size):
        (B, k, H), T = valid.shape, tokens.shape[1] - tr.k * valid.shape[2]
        record = []
        record.append(pseudo_states(model, tr, tokens, pos, vis, hosts, record))
        idx = teacher.view(B, k * H, 1).expand(-1, -1, model.args.dim)
        for n, x in enumerate(record):
            cos = F.cosine_similarity(x[:, T:], x[:, :T].gather(1, idx), dim=-1).view(B, k, H)
            total[n] += (cos * valid).sum((0, 2))
        count += valid.sum((0, 2))
    sims = (total / count).tolist()
    return [[v if n >= t else None for v, t in zip(row, tr.layers)] for n, row in enumerate(sims)]


def analyze(args):
    """Figures 3, 4 and 7 on held-out data for the trained maps in args.out."""
    from . import propd
    from .medusa import accuracy as medusa_accuracy, load_heads, samples as medusa_samples
    model, train_data, held = distilled(args)
    tr, meta = load_transfer(model, args.out)
    k, pct = tr.k, lambda a: f"{a[0]:.3f} / {sum(a[:5]):.3f}"
    print(f"hidden transfer at layers {tr.layers} (trained with the {meta['attention']} attention); "
          f"held-out top-1 / top-5 per step, {len(held)} sequences")
    rows = {"hidden transfer": accuracy(model, tr, held, "chain", 5),
            "hidden transfer, pseudo states masked from each other": accuracy(model, tr, held, "masked", 5)}
    if (Path(args.out) / "medusa.safetensors").is_file():
        heads, _ = load_heads(model, args.out)
        rows["medusa heads"] = medusa_accuracy(heads, *medusa_samples(model, held, len(heads.proj)), 5)
    early = []
    for i, t in enumerate(tr.layers if args.early_steps else []):
        head = propd.train_early(model, train_data, t, args.early_steps, args.early_rank, ahead=i + 2, seed=args.seed)
        hits = propd.topk_hits(head, *propd.samples(model, held, t, ahead=i + 2), ks=(1, 5))
        early.append([hits[1], hits[5] - hits[1]])
    if early:
        rows["early exit (same layers)"] = early
    print("\nFigure 3: draft accuracy, top-1 / top-5")
    print("| drafter | " + " | ".join(f"step {i + 1} (t+{i + 2})" for i in range(k)) + " |")
    print("|---|" + "---|" * k)
    for name, acc in rows.items():
        print(f"| {name} | " + " | ".join(pct(a) for a in acc[:k]) + " |")
    print("\nFigure 4: cosine similarity of pseudo and real hidden states")
    print("| after layer | " + " | ".join(f"step {i + 1}" for i in range(k)) + " |")
    print("|---|" + "---|" * k)
    for n, row in enumerate(similarity(model, tr, held)):
        if n < tr.layers[0]:
            continue
        name = "final norm" if n > len(model.layers) else str(n)
        print(f"| {name} | " + " | ".join("" if v is None else f"{v:.3f}" for v in row) + " |")


def train(args):
    if args.analyze:
        return analyze(args)
    out = Path(args.out)
    model, train_data, held = distilled(args)
    torch.manual_seed(args.seed)
    tr = Transfer(model.args.dim, [int(t) for t in args.layers.split(",")]).check(model.args.n_layers)
    opt = adamw(tr, args.lr, weight_decay=0.0)
    prog = Progress(args.steps, every=10)
    for step, (tokens, pos, vis, hosts, valid, teacher, _) in enumerate(
            batches(train_data, tr.k, args.attention, args.batch_size, args.seed, args.steps)):
        lr = cosine_lr(step, args.steps, args.lr, warmup=min(20, args.steps // 10 + 1))
        loss, per_step = kl_loss(model, pseudo_states(model, tr, tokens, pos, vis, hosts), valid, teacher)
        update(opt, loss, lr, each=True)  # clipped per W_i: as if each step trained alone
        prog.step(step, loss.item(), lr, int(tokens.numel()), kl=" ".join(f"{v:.3f}" for v in per_step.tolist()))
    acc = accuracy(model, tr, held, "masked" if args.attention == "masked" else "chain", args.topk)
    for i, a in enumerate(acc):
        print(f"step {i + 1} (layer {tr.layers[i]}, token t+{i + 2}): held-out top-1 {a[0]:.3f}, "
              f"top-5 {sum(a[:5]):.3f}")
    meta = {"base_fingerprint": fingerprint(model), "layers": tr.layers, "attention": args.attention,
            "acc": acc, "tree": choose_tree(acc, args.tree_size),
            "trained": {"steps": args.steps, "seconds": round(prog.elapsed)}}
    save_drafter(out / "hidden_transfer.safetensors", tr, meta)
    print(f"wrote {out / 'hidden_transfer.safetensors'}: steps at layers {tr.layers}")
