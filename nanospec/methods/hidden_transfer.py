"""Hidden Transfer (Wu et al., 2024): forged hidden states of future tokens in middle layers.

Spec: Pengfei Wu, Jiahao Liu, Zhuocheng Gong, Qifan Wang, Jinpeng Li, Jingang Wang, Xunliang Cai, Dongyan Zhao,
"Parallel Decoding via Hidden Transfer for Lossless Large Language Model Acceleration", 2024, arXiv:2404.12022
(sections 3.2-3.4, 4.4-4.5, Figures 2-7).

k transfer steps. Step i is a d x d linear map W_i at layer t_i (t_1 < t_2 < ...): the residual state of a real token
x_p after t_i layers, mapped by W_i, becomes a pseudo hidden state of the token p+i. It runs through the remaining
layers at position p+i, attending to the context, to the token's tree path and to the earlier pseudo states of its
own chain (the serialized prediction the paper argues for), and the original norm + lm_head decode it: pseudo state i
predicts the token at p+i+1, the depth-i draft. The base model is frozen.

Each step runs one forward: the tree (verified exactly as AR would) plus a group of k pseudo rows on every tree node,
so the group of the last accepted node drafts the next tree (Figure 2). No tree row sees a pseudo row. Fast mode adds
pseudo rows at their layer (no compute below it); exact mode runs them as placeholder rows through every layer and
overwrites them at t_i.

Choices where the paper is silent, and why:
- "Layer t" is the residual stream after t layers; W_i is initialised to the identity (the copy mechanism the paper
  starts from), with no bias.
- Loss: KL(P || P~) with the base model's distribution P at the pseudo state's position as the target, averaged over
  positions, summed over steps. Positions: every token of the answer part of the self-distillation data (where
  drafting happens), as hosts; with --forced, also every token of teacher-forced real text (training/forced.py) in
  --piece-token sequences, where P is the model's own distribution whatever the text.
- Under a planner (fast mode's default), a node's group holds the first min(k, budget) pseudo rows: the next tree is
  at most budget deep (drafter.Ranked). A pseudo row never sees a later one, so these forge as in a whole group.
- Training attention (`--attention`): `paper` (default; section 3.3: pseudo state of step i on host j sees real
  tokens up to j+i-1 and itself), `chain` (what decoding sees: real tokens up to j, the earlier pseudo states of its
  chain, itself) or `masked` (real tokens up to j and itself: Figure 7's ablation). Under `paper` and `masked` the
  steps never see each other, so training them together in one forward is training them separately: the gradient of
  W_i comes from step i alone, AdamW is per parameter and the gradient is clipped per W_i.
- Layers (5, 6, 7) of the default model's 8, from the sweep of Figures 5-6 (RESULTS.md, "Hidden Transfer"): the
  latest layers at which acceptance stays at its best, since a pseudo row runs only the layers from its own; the
  learning rate is the sweep's best too.
- The tree is chosen from Hidden Transfer's own held-out accuracies (saved by the trainer), as Medusa's is from its
  heads'; `tree_size=N` picks another size. (The paper compares the two at Medusa's tree; a drafter here never reads
  another method's weights.)
- The first step has no pseudo states yet: it is the root and its group (one AR step that already drafts).

What runs where: the layer loop that forges pseudo rows, one lm_head product over the real and the pseudo rows (the
head's weights read once a step) and verification are one device program (a CUDA graph per tree size in exact mode on
a GPU: its row indices depend on that size alone). The layer loop is shared with the trainer (`transfer`, over the
core's Forward), so training forges exactly what decoding does.
"""
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..drafter import RANDOM_ACC, Out, Ranked, noisy
from ..forward import Forward
from ..io.checkpoint import load_trained, save_drafter
from ..io.files import fingerprint
from ..training.data import distill_args
from ..training.forced import start, training_items
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, update
from ..tree import Groups, Template, choose_tree, group_row_index

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


def transfer(f: Forward, tr: Transfer, x, hosts, rows, record=None):
    """The paper's step: run the layers over real and pseudo rows; returns the final normed states.

    x (B, R, D): the rows' inputs (pseudo rows' are placeholders). hosts (B, H): the real rows the pseudo rows are made
    from; rows[i] (H,): the step-i pseudo rows. At layer t_i, pseudo row i of host j becomes W_i x_j and from then on
    runs with the others. record: a list that receives the states after 0, 1, ..., L layers (Figure 4)."""
    L = len(f.model.layers)
    active = torch.ones(x.shape[1], dtype=torch.bool, device=x.device).index_fill(0, torch.cat(rows), False)
    idx = hosts[..., None].expand(-1, -1, x.shape[-1])
    bounds = sorted({0, L, *tr.layers}) if record is None else range(L + 1)
    for a, b in zip(bounds, bounds[1:]):
        for i, t in enumerate(tr.layers[:len(rows)]):  # the steps whose rows run (a budget's)
            if t == a:  # step i's pseudo rows join here, forged from their hosts
                x = x.index_copy(1, rows[i], F.linear(x.gather(1, idx), tr.W[i].to(x.dtype)))
                active = active.index_fill(0, rows[i], True)
        if record is not None:
            record.append(x)
        x = f.layers(x, a, b, active)
    if record is not None:
        record.append(x)
    return f.norm(x)


# --- decoding ----------------------------------------------------------------------------------

class HiddenTransfer(Ranked):
    name = "hidden_transfer"
    own_rows = "pseudo rows"  # what the rows after the tree are (show.py)
    floor = 2.2  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, tr: Transfer, paths: list[tuple[int, ...]], chained: bool = True):
        self.tr, self.chained = tr, chained
        self.template = Template(paths)
        if self.template.depth > tr.k:
            raise NanospecError(f"the tree is {self.template.depth} deep but there are {tr.k} transfer steps")
        self.ahead = tr.k  # pseudo rows per node: k, or a planner's budget's worth (Ranked.own_depths)
        self.max_rows = self.rows(len(self.template))
        self.topk = self.template.topk

    @classmethod
    def load(cls, model, weights, tree_size=0, chained=True) -> "HiddenTransfer":
        tr, meta = load_transfer(model, weights)
        paths = choose_tree(meta["acc"], tree_size) if tree_size else meta["tree"]
        return cls(tr, [p for p in paths if len(p) <= tr.k], chained)

    @classmethod
    def random(cls, model, seed=0) -> "HiddenTransfer":
        """Noisy identity maps at the first two layers after the embedding (the first alone in a 2-layer model); an
        odd seed's pseudo rows each see only themselves (chained=False)."""
        layers = sorted({1, min(2, model.args.n_layers - 1)})
        tr = noisy(Transfer(model.args.dim, layers), seed, 0.3).to(model.embed.weight)
        return cls(tr, choose_tree(RANDOM_ACC[:len(layers)], 8), chained=seed % 2 == 0)

    def rows(self, n, budget=None):
        return n * (1 + self.own_depths(budget))  # every node carries a group of pseudo rows

    def groups(self, tree, n, budget=None):
        return Groups(tuple(range(n)), self.own_depths(budget), chained=self.chained)

    def forward(self, f, nodes):
        n, k, device = nodes.largest, nodes.M, f.block.tokens.device
        x = f.embed()  # every node hosts a group: pseudo row i of each is tree.group_row_index's row i
        pos = torch.arange(n, device=device).expand(len(x), n)
        h = transfer(f, self.tr, x, pos, list(group_row_index(n, n, k, device)))
        logits = f.logits(h, max(nodes.N, n * (1 + k)))  # the tree's and the pseudo rows' in one product: one pass
        pseudo = logits[:, n:n * (1 + k)].view(len(h), n, k, -1)  # pseudo row i of a node drafts its depth i
        return Out(logits[:, :nodes.N], draft_inputs=pseudo)


# --- weights on disk ---------------------------------------------------------------------------
def load_transfer(model, weights):
    return load_trained(model, Path(weights) / "hidden_transfer.safetensors",
                        "python train.py --method hidden_transfer",
                        lambda meta: Transfer(model.args.dim, meta["layers"]).check(model.args.n_layers))


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
    p.add_argument("--piece", type=int, default=128, help="tokens per training sequence of the --forced data")


def pack(seqs: list[list[int]], starts: list[int], k: int, attention: str, device="cpu"):
    """A packed batch on device: T real rows, then k blocks of H pseudo rows (step i, host j = start-1+h, one per answer
    token). Returns (tokens, pos, vis (B, R, R), hosts (B, H), valid (B, k, H), teacher (B, k, H): the real row whose
    distribution pseudo row (i, h) learns, label (B, k, H): the token after it, -100 past the end)."""
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
    return tuple(torch.stack(x).to(device) for x in zip(*out))


def pseudo_states(model, tr: Transfer, tokens, pos, vis, hosts, record=None):
    """Final normed states (B, R, D) of a packed batch: cache-free, the model frozen, through decoding's layer loop."""
    R, H = tokens.shape[1], hosts.shape[1]
    T = R - tr.k * H
    f = Forward.training(model, tokens, pos, vis)
    rows = [T + i * H + torch.arange(H, device=tokens.device) for i in range(tr.k)]
    return transfer(f, tr, f.embed(), hosts, rows, record)


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


def batches(items, k, attention, batch_size, gen, steps, device="cpu"):
    """Random batches of (tokens, labels) items, every labelled position a host (training/forced.py)."""
    for _ in range(steps):
        part = [items[i] for i in torch.randint(0, len(items), (batch_size,), generator=gen).tolist()]
        yield pack([t for t, _ in part], [start(lab) for _, lab in part], k, attention, device)


def ordered(data, k, attention, batch_size, device="cpu"):
    """Every sequence of data once, in order: held-out evaluation."""
    for i in range(0, len(data), batch_size):
        part = data[i:i + batch_size]
        yield pack([p + c for p, c in part], [len(p) for p, _ in part], k, attention, device)


@torch.no_grad()
def accuracy(model, tr, data, attention="chain", topk=10, batch_size=8):
    """acc[i][r]: how often step i's rank-r candidate is the model's greedy token on held-out
    sequences, by default with the attention decoding uses (chain)."""
    acc = RankAccuracy(tr.k, topk)
    for tokens, pos, vis, hosts, valid, teacher, label in ordered(data, tr.k, attention, batch_size,
                                                                  model.embed.weight.device):
        (B, k, H), T = label.shape, tokens.shape[1] - tr.k * label.shape[2]
        h = pseudo_states(model, tr, tokens, pos, vis, hosts)
        acc.add(model.lm_head(h[:, T:]).view(B, k, H, -1).transpose(1, 2), label.transpose(1, 2))
    return acc.result()


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)
    train_items = training_items(model, args, train_data, piece=args.piece)
    positions = sum(len(t) - start(lab) + 1 for t, lab in train_items)
    print(f"hidden transfer: {len(train_items):,} training sequences, {positions:,} host positions", flush=True)
    torch.manual_seed(args.seed)
    tr = Transfer(model.args.dim, [int(t) for t in args.layers.split(",")]).check(model.args.n_layers)
    tr.to(model.embed.weight.device)
    opt = adamw(tr, args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = Checkpoint(args, f"hidden_transfer-{fingerprint(model)}", tr, opt, [gen], every=20)
    prog = ckpt.progress(args.steps, every=10)
    data = batches(train_items, tr.k, args.attention, args.batch_size, gen, args.steps - ckpt.start,
                   model.embed.weight.device)
    for step, (tokens, pos, vis, hosts, valid, teacher, _) in zip(ckpt.steps(), data):
        lr = cosine_lr(step, ckpt.total, args.lr, warmup=min(20, args.steps // 10 + 1))
        loss, per_step = kl_loss(model, pseudo_states(model, tr, tokens, pos, vis, hosts), valid, teacher)
        update(opt, loss, lr, each=True)  # clipped per W_i: as if each step trained alone
        prog.step(step, loss.item(), lr, int(tokens.numel()), kl=" ".join(f"{v:.3f}" for v in per_step.tolist()))
    acc = accuracy(model, tr, held, "masked" if args.attention == "masked" else "chain", args.topk)
    for i, a in enumerate(acc):
        print(f"step {i + 1} (layer {tr.layers[i]}, token t+{i + 2}): held-out top-1 {a[0]:.3f}, "
              f"top-5 {sum(a[:5]):.3f}")
    meta = {"base_fingerprint": fingerprint(model), "layers": tr.layers, "attention": args.attention,
            "acc": acc, "tree": choose_tree(acc, args.tree_size),
            "trained": {"positions": positions, "forced": args.forced} | ckpt.record()}
    save_drafter(out / "hidden_transfer.safetensors", tr, meta)
    print(f"wrote {out / 'hidden_transfer.safetensors'}: steps at layers {tr.layers}")
