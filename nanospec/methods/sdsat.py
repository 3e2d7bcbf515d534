"""SDSAT (Liu et al., 2024): semantic adaptive tokens, draft-then-verify with the model itself.
Spec: ../shared/papers/sdsat.txt (sections 2.1-2.2, 3.2, 3.4, appendices A-B).

An adaptive token placed after a sequence predicts a token further ahead: adaptive token i (1-based) appended after
position n predicts the token at n+i+1. Decoding appends k adaptive tokens (k is free at inference) and drafts from
them, then verifies the drafts and drafts again in the next forward:
- Draft step 1: the last token and k adaptive tokens after it. The last token's own logits give the next token; the
  adaptive rows give k draft tokens.
- Draft step 2: the next token and the k drafts as a chain, with k adaptive tokens after the last draft. The chain is
  verified exactly as AR would (eq. 3), and when every draft is accepted the adaptive rows already hold the next k
  drafts, so the next loop needs no step 1. Otherwise the next step is a step 1 again. A loop of two forwards yields
  up to k+2 tokens.
- Nucleus sampling: `width` > 1 turns the chain into a tree of each adaptive position's top candidates, where only the
  top-1 candidate of each depth has children (adaptive tokens ride on the top-1 chain's end), verified with the
  engine's seeded sampler.

Where this departs from the paper, toward its own stated aim ("a training method that does not affect the standard
tokens"): the paper fine-tunes every weight, so standard tokens change a little and the AR reference becomes the fine-
tuned model. Here the model is untouched:
- The adaptive token is a new embedding row (Delta.embed), not one of the vocabulary's ids.
- A rank-r update of every attention and MLP projection applies to adaptive rows only (the forward's `delta`,
  model.Context.mm). Standard rows run the base weights, and adaptive rows read the standard rows' keys and values
  unchanged; standard rows never see adaptive rows.
- So every standard token's output is the base model's own, bitwise in exact mode: SDSAT's AR reference is the base
  model, and the method ships as a small drafter file (sdsat.safetensors).
The paper's full fine-tune stays as sdsat_full.py: with the same data it drafts more per forward (RESULTS.md, "SDSAT
without touching the model"), since it also teaches the standard tokens' keys and values what the adaptive tokens
need. Training has only adaptive rows to learn: the standard rows' keys and values come from a no-grad forward of the
frozen model, and only adaptive rows run backward; eq. 9's plain term is a constant, eq. 8's and 9's mixed terms the
adaptive rows' loss.

Choices where the paper is silent, and why:
- Masking (section 2.2): each position starts a window with probability 0.1 (position 0 never), of a length uniform on
  1..L. An adaptive token at position i is labelled with the token at i+1, as at inference. Windows are separate rows,
  each seeing the standard tokens before it and its own earlier rows, which is what inference shows an adaptive token;
  so windows need not merge.
- With `--diverse` (appendix B), window position i gets its own embedding, and k <= L.
- Rank 8: the update's size stays a few MB on SmolLM2 (30 layers); the adaptive embedding and B start at N(0, 0.02)
  and zero (the base model's own rows), A at N(0, 1/in).
- Data: windows of --seq-len tokens of the self-distillation data (prompts labelled as plain text, as in the paper)
  and of --forced windows of real text, labelled with the model's own tokens where known (training/forced.py).
- Under a planner (fast mode's default), a step appends min(k, budget) adaptive tokens, not k (drafter.Ranked), and
  the adaptive rows' logits come from the step's one head product, with the tree's.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..drafter import Forward, Out, Ranked
from ..io.checkpoint import load_trained, save_drafter
from ..io.files import fingerprint
from ..training.data import distill_args
from ..training.forced import forced_items, targets
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, update
from ..training.pretrain import windows
from ..tree import Template, chain_end

TRAIN = "python train.py --method sdsat"
PROJECTIONS = {"attn.qkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "attn.o_proj": ("attn.o_proj",),
               "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}


class Delta(nn.Module):
    """The adaptive tokens' embeddings and a rank-r update W + B A of every projection of every layer, applied to
    adaptive rows only. A layer's products are told apart by role (the name it sets on them: a compiled layer,
    tuning/compiled.py, sees the same code for every layer); a fused product (q, k and v; gate and up) takes its
    parts' updates side by side (A stacked, B block-diagonal)."""

    def __init__(self, model, rank: int = 8, tokens: int = 1):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(tokens, model.args.dim) * 0.02)
        self.n, layers = len(model.layers), model.layers
        shapes = {k.removesuffix(".weight"): w.shape for k, w in layers[0].state_dict().items()}  # (out, in) per part
        keys = {part: part.replace(".", "_") for parts in PROJECTIONS.values() for part in parts}
        self.a = nn.ParameterDict({k: nn.Parameter(torch.randn(self.n, rank, shapes[p][1]) / shapes[p][1] ** 0.5)
                                   for p, k in keys.items()})
        self.b = nn.ParameterDict({k: nn.Parameter(torch.zeros(self.n, shapes[p][0], rank)) for p, k in keys.items()})
        self.keys = {m: [keys[p] for p in parts] for m, parts in PROJECTIONS.items()}
        self.groups = {m: getattr(layers[0].get_submodule(m), "groups", 1) for m in PROJECTIONS}
        for layer, m in ((layer, m) for layer in layers for m in PROJECTIONS):
            layer.get_submodule(m).role = m

    def factors(self) -> list[dict]:
        """Per layer, {a product's role: (A^T, B^T)}, made of the parameters (gradients flow). B^T's columns follow
        the fused product's: each part's in `groups` chunks, interleaved (model.fuse)."""
        def b(keys, i, groups):
            parts = torch.block_diag(*[self.b[k][i].t() for k in keys]).split([len(self.b[k][i]) for k in keys], 1)
            return torch.cat([c for g in zip(*(p.chunk(groups, 1) for p in parts)) for c in g], 1)
        return [{m: (torch.cat([self.a[k][i].t() for k in keys], 1), b(keys, i, self.groups[m]))
                 for m, keys in self.keys.items()} for i in range(self.n)]

    def on(self, rows, factors: list | None = None) -> list["Update"]:
        """The update as a forward's per-layer `delta` (model.Context.delta) on rows (slice, index; None: all) of
        every sequence; other products and rows keep theirs. factors: `factors()`, made once or now."""
        return [Update(rows, f) for f in (self.factors() if factors is None else factors)]


@dataclass
class Update:
    """A layer's update of its products on rows: data, not a closure, so a compiled layer takes it as inputs."""
    rows: object  # a slice, an index tensor, or None: all rows
    factors: dict

    def __call__(self, layer, x, y):
        ab = self.factors.get(getattr(layer, "role", None))
        if ab is None:
            return y
        if self.rows is None:
            return y + (x @ ab[0]) @ ab[1]
        a, b = (t.expand(len(x), -1, -1) for t in ab)
        y[:, self.rows] = torch.baddbmm(y[:, self.rows], torch.bmm(x[:, self.rows], a), b)  # in the epilogue
        return y


class SDSAT(Ranked):
    name = "sdsat"

    def __init__(self, delta: Delta | None, k: int = 5, width: int = 1, ids: list[int] | None = None):
        """delta: the adaptive tokens and their update, on the base model; or (sdsat_full) ids: the
        adaptive tokens' vocabulary ids in a fine-tuned model."""
        if k < 1 or width < 1:
            raise NanospecError(f"sdsat k={k}, width={width}: both must be at least 1")
        n = len(ids) if delta is None else len(delta.embed)
        if 1 < n < k:
            raise NanospecError(f"sdsat k={k}: this drafter was trained with {n} diverse adaptive tokens; use k <= {n}")
        self.delta, self.k, self.width = delta, k, width
        self.factors = None if delta is None else [{m: (a.detach().contiguous(), b.detach().contiguous())
                                                    for m, (a, b) in f.items()} for f in delta.factors()]
        self.ids = None if ids is None else (ids * k if n == 1 else ids[:k])  # identical or diverse tokens
        self.family = [(0,) * d + (j,) for d in range(k) for j in range(width)]  # top-1s have children
        self.template = Template(self.family)
        self.topk = self.template.topk
        self.ahead = self.now = k  # adaptive tokens: k, or a planner's budget's worth (Ranked)
        self.max_rows = self.size(len(self.template))
        self.verifying = self.drafts = self.drafts_accepted = self.draft_only = 0  # statistics for report()

    def size(self, n, budget=None):
        return n + self.own(budget)

    def rows(self, dec, tree, n):
        """The tree, then the adaptive rows after the end of its top-1 chain (forward embeds them)."""
        blk = dec.block(tree, [chain_end(tree.parents)], self.now, n=n)
        if self.ids is not None:
            blk.tokens[0, n:] = blk.tokens.new_tensor(self.ids[:self.now])
        return blk

    def shape_key(self, nodes):
        return nodes.n, self.now

    def forward(self, f, nodes):
        n, k, N = nodes.n, self.now, nodes.N
        x = f.embed()
        if self.delta is None:  # a fine-tuned model's own adaptive ids
            h = f.norm(f.layers(x))
        else:
            e = self.delta.embed  # one adaptive token repeated, or the first k diverse ones
            x[:, n:n + k] = (e.expand(k, -1) if len(e) == 1 else e[:k]).to(x.dtype)
            h = f.norm(f.layers(x, delta=self.delta.on(slice(n, n + k), self.factors)))
        logits = f.logits(h, max(N, n + k))  # the tree's and the adaptive rows' in one product: one pass of the head
        adaptive = logits[:, None, n:n + k]  # drafts for the next loop, if the whole top-1 chain is accepted
        depth = nodes.lay.depth[:, :n].masked_fill(~nodes.real[:, :n], -1)  # the chain's end: the first deepest node
        host = torch.arange(N, device=h.device) == depth.argmax(-1, keepdim=True)  # (argmax: the first of ties)
        return Out(logits[:, :N], drafts=adaptive.expand(-1, N, -1, -1), depths=torch.where(host, k, 0))

    def accepted(self, dec, tree, path):
        if len(tree) > 1:
            self.verifying += 1
            self.drafts += len(tree) - 1
            self.drafts_accepted += len(path) - 1
        else:
            self.draft_only += 1

    def report(self):
        """Figure 3's accept rate: drafts accepted per draft verified (per verifying step over k, for a chain)."""
        n, planned = max(self.verifying, 1), super().report()
        return (f"accept rate {self.drafts_accepted / max(self.drafts, 1):.3f} ({self.drafts_accepted / n:.2f} of "
                f"{self.drafts / n:.2f} drafts per verifying step); {self.draft_only} draft-step-1 forwards"
                + (f"; {planned}" if planned else ""))


def load_delta(model, weights) -> tuple[Delta, dict]:
    """The trained update and its file's metadata (its window and token count: how it was trained)."""
    return load_trained(model, Path(weights) / "sdsat.safetensors", TRAIN,
                        lambda meta: Delta(model, meta["rank"], meta["tokens"]))


def load_sdsat(model, weights, k=5, width=1) -> SDSAT:
    return SDSAT(load_delta(model, weights)[0], k, width)


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    p.add_argument("--window", type=int, default=5, help="L: the longest run of adaptive tokens")
    p.add_argument("--mask-rate", type=float, default=0.1, help="chance that a position starts a window")
    p.add_argument("--diverse", action="store_true", help="a different adaptive token per window position")
    p.add_argument("--rank", type=int, default=8, help="r of the projections' update")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=40)
    distill_args(p)


def starts(T: int, L: int, rate: float, gen, full: bool = False) -> list[tuple[int, int]]:
    """Section 2.2's windows in a sequence of T tokens: (start, length) for each position that starts one
    (probability `rate`, position 0 never), of a length uniform on 1..L (full: L)."""
    s = ((torch.rand(T, generator=gen) < rate) & (torch.arange(T) > 0)).nonzero()[:, 0]
    lengths = torch.full_like(s, L) if full else torch.randint(1, L + 1, s.shape, generator=gen)
    return list(zip(s.tolist(), lengths.tolist()))


def adaptive_rows(x: torch.Tensor, wins: list[list[tuple[int, int]]], diverse: bool, ahead=None):
    """Each window's adaptive rows over sequences x (B, T): (embedding index, position, visibility over the T
    standard keys then the rows, label), padded to the longest sequence's rows (label -100: none). Row j of a
    window at s sits at s+j, sees standard keys 0..s-1 and rows 0..j of its window, and is labelled x[s+j+1], or
    with `ahead` (B, T, L) ahead[s-1, j]: the model's own token j+2 after s-1 where known (training/forced.py)."""
    (B, T), R = x.shape, max(1, max(sum(n for _, n in w) for w in wins))
    which, pos, lab = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R, dtype=torch.long), torch.full((B, R), -100)
    vis = torch.zeros(B, R, T + R, dtype=torch.bool)
    vis[:, :, 0] = True  # padding rows see key 0, so their softmax is defined
    after = F.pad(x, (0, R), value=-100)  # the token after each position; none past the end
    for b, w in enumerate(wins):
        r = 0
        for s, n in w:
            j = torch.arange(n)
            which[b, r:r + n] = j if diverse else 0
            pos[b, r:r + n] = s + j
            vis[b, r:r + n, :T] = torch.arange(T) < s
            vis[b, r:r + n, T + r:T + r + n] = j[None] <= j[:, None]
            lab[b, r:r + n] = after[b, s + j + 1] if ahead is None else ahead[b, s - 1, :n]
            r += n
    return which, pos, vis, lab


@torch.no_grad()
def base_keys(model, x: torch.Tensor) -> list:
    """The frozen model's keys and values (B, Hkv, T, D) in every layer over x (B, T), causal."""
    B, T = x.shape
    pos = torch.arange(T, device=x.device).expand(B, T)
    f = Forward.training(model, x, pos, torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T))
    kv, kept = f.kv, []
    f.kv = lambda i: kept.append(kv(i)) or kept[-1]  # the buffers each layer writes its keys into
    f.layers(f.embed())
    return kept


def adaptive_logits(model, delta: Delta, x: torch.Tensor, wins, diverse: bool, ahead=None):
    """Logits (B, R, V) of the adaptive rows of windows `wins` over x (B, T), and their labels (adaptive_rows)."""
    keys = base_keys(model, x)
    which, pos, vis, lab = (t.to(x.device) for t in adaptive_rows(x.cpu(), wins, diverse, ahead))
    f = Forward.training(model, torch.zeros_like(pos), pos, vis, prefix=lambda i: keys[i])
    h = f.norm(f.layers(delta.embed[which], delta=delta.on(None)))
    return model.lm_head(h), lab


@torch.no_grad()
def accuracy(model, delta, held, args, top: int = 5) -> list[list[float]]:
    """Held-out top-`top` accuracy per window position (acc[j][r]: rank r is the token j+2 ahead)."""
    acc, gen = RankAccuracy(args.window, top), torch.Generator().manual_seed(1)
    for p, c in held:
        x = torch.tensor([p + c], device=model.embed.weight.device)
        wins = [(s, n) for s, n in starts(len(p + c), args.window, 0.1, gen, full=True) if s >= len(p)]
        if wins:
            logits, lab = adaptive_logits(model, delta, x, [wins], args.diverse)
            acc.add(logits.view(-1, args.window, logits.shape[-1]), lab.view(-1, args.window))
    return acc.result()


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)
    data = [(p + c, (p + c)[1:] + [-100]) for p, c in train_data] + forced_items(model, args)  # (tokens, labels)
    tokens = [t for s, _ in data for t in s]
    stream, ahead = torch.tensor(tokens), targets(tokens, [v for _, lab in data for v in lab], args.window)  # (N, L)
    torch.manual_seed(args.seed)
    delta = Delta(model, args.rank, args.window if args.diverse else 1).to(model.embed.weight)
    opt = adamw(delta, args.lr, weight_decay=0.0)
    ckpt = Checkpoint(args, f"sdsat-{fingerprint(model)}", delta, opt, every=20)
    prog = ckpt.progress(args.steps, every=10)
    print(f"sdsat: a rank-{args.rank} update, {sum(p.numel() for p in delta.parameters()):,} parameters; "
          f"{len(stream):,} training tokens ({args.forced:,} teacher-forced), L={args.window}", flush=True)
    index = np.arange(len(stream))  # windows are drawn as positions: the tokens' and the labels' alike
    for step in ckpt.steps():
        g = torch.Generator().manual_seed(args.seed * 7919 + step)  # each step's batch: resumes see the same
        at = windows(index, args.batch_size, args.seq_len, g)[:, :-1]
        x = stream[at].to(model.embed.weight.device)
        wins = [starts(args.seq_len, args.window, args.mask_rate, g) for _ in range(len(x))]
        logits, lab = adaptive_logits(model, delta, x, wins, args.diverse, ahead[at])
        loss = F.cross_entropy(logits.float().flatten(0, 1), lab.flatten())
        lr = cosine_lr(step, ckpt.total, args.lr, args.warmup)
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, int((lab >= 0).sum()))
    acc = accuracy(model, delta, held, args)
    for j, a in enumerate(acc):
        print(f"adaptive token {j + 1} (token t+{j + 2}): held-out top-1 {a[0]:.3f}, top-5 {sum(a):.3f}")
    trained = {k: getattr(args, k) for k in ("forced", "seq_len", "batch_size", "lr")} | ckpt.record()
    meta = {"base_fingerprint": fingerprint(model), "rank": args.rank, "tokens": len(delta.embed), "acc": acc,
            "window": args.window, "mask_rate": args.mask_rate, "trained": trained}
    save_drafter(out / "sdsat.safetensors", delta, meta)
    print(f"wrote {out / 'sdsat.safetensors'}")
