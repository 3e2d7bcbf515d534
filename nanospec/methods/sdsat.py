"""SDSAT: draft-then-verify with the model itself, through semantic adaptive tokens.

Liu & Zhu, "SDSAT: Accelerating LLM Inference through Speculative Decoding with Semantic Adaptive Tokens", 2024,
arXiv:2403.18647: sections 2.1 (inference), 2.2 (training), 3.2, 3.4 (Figure 3's accept rate), appendices A-B.

Adaptive token i (1-based) after position n predicts the token at n+i+1: k of them (k is free at inference) draft
k tokens in one forward. A loop of two forwards yields up to k+2 tokens (SDSAT.draft):
- Draft step 1 (eq. 1): the last token, whose logits give the next token, and k adaptive tokens after it: k drafts.
- Draft step 2 (eqs. 2-3): the next token and the k drafts as a chain, verified as AR would; unlike the paper, k
  adaptive tokens follow the chain too, drafting the next k: if all are accepted the next forward is a step 2 again,
  else a step 1 (a second group on the root would spare it, but on a CPU its rows cost more than it saves: RESULTS.md).
- Nucleus sampling (section 2.1.2): `width` > 1 makes step 2's chain a tree of each depth's top candidates.

The paper fine-tunes every weight (sdsat_full.py: on the same data it drafts more per forward, RESULTS.md's "SDSAT
without touching the model"). For its own aim ("a training method that does not affect the standard tokens"), the model
here is untouched: the adaptive token is a new embedding row, and a rank-r update of every product (Delta) applies to
adaptive rows only, which standard rows never see: every standard token is the base model's, bitwise in exact mode, and
it ships as a small drafter file. Adaptive rows learn over the frozen keys and values (eq. 9's plain term a constant,
eqs. 8-9's mixed terms their loss) in windows of their own rows seeing the standard tokens before them as at inference:
windows need not merge. `--diverse` (appendix B): an embedding per window position (k <= L). Data: self-distillation
(prompts labelled as plain text, as in the paper) and --forced real text labelled with the model's own tokens.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..drafter import Out, Ranked, noisy
from ..forward import Forward
from ..io.checkpoint import load_trained, save_drafter
from ..io.files import fingerprint
from ..training.data import distill_args
from ..training.forced import forced_items, targets
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, update
from ..training.pretrain import windows
from ..tree import Groups, Template, Tree, chain_end

TRAIN = "python train.py --method sdsat"
# A layer's products, by the role each has (fused.Product), and the parts they fuse, as checkpoints name them
PROJECTIONS = {"qkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "o_proj": ("attn.o_proj",),
               "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


class Delta(nn.Module):
    """The adaptive tokens' embeddings and a rank-r update W + B A of each product of every layer, by the product's
    role (fused.Product); a fused product (q, k and v; gate and up) takes its parts' (A stacked, B block-diagonal)."""

    def __init__(self, model, rank: int = 8, tokens: int = 1):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(tokens, model.args.dim) * 0.02)
        self.n, layer = len(model.layers), model.layers[0]
        shapes = {k.removesuffix(".weight"): w.shape for k, w in layer.state_dict().items()}  # (out, in) per part
        parts = {p.replace(".", "_"): shapes[p] for ps in PROJECTIONS.values() for p in ps}  # by parameter name
        self.a = nn.ParameterDict({k: nn.Parameter(torch.randn(self.n, rank, i) / i ** 0.5)
                                   for k, (_, i) in parts.items()})
        self.b = nn.ParameterDict({k: nn.Parameter(torch.zeros(self.n, o, rank)) for k, (o, _) in parts.items()})
        self.keys = {role: [p.replace(".", "_") for p in ps] for role, ps in PROJECTIONS.items()}

    def factors(self) -> list[dict]:
        """Per layer, {a product's role: (A^T, B^T)}, made of the parameters (gradients flow). B^T's columns follow
        the fused product's: its parts' stacked (fused.fuse)."""
        return [{role: (torch.cat([self.a[k][i].t() for k in keys], 1),
                        torch.block_diag(*[self.b[k][i].t() for k in keys]))
                 for role, keys in self.keys.items()} for i in range(self.n)]

    def on(self, rows, factors: list | None = None) -> list["Update"]:
        """The update as a forward's per-layer `delta` (forward.Context.delta) on rows (slice, index; None: all) of
        every sequence; other rows keep the base products. factors: `factors()`, made once or now."""
        return [Update(rows, f) for f in (self.factors() if factors is None else factors)]


@dataclass
class Update:
    """A layer's update of its products on rows: data, not a closure, so the compiled layer (one code for every
    layer: compiled.py) takes it as inputs, and finds each product's factors by the role the model gave it."""
    rows: slice | None  # a slice (its outputs are updated in place), or None: all rows
    factors: dict  # {a product's role: (A^T, B^T)}

    def __call__(self, product, x, y):
        a, b = self.factors[product.role]
        if self.rows is None:
            return y + (x @ a) @ b
        a, b = a.expand(len(x), -1, -1), b.expand(len(x), -1, -1)
        y[:, self.rows].baddbmm_(torch.bmm(x[:, self.rows], a), b)  # the rows' outputs, updated in place
        return y


class SDSAT(Ranked):
    """Draft steps 1 and 2 (module docstring): k adaptive tokens, `width` candidates per depth. delta: the adaptive
    tokens and their update on the base model; or (sdsat_full) ids: their vocabulary ids in a fine-tuned model."""
    name = "sdsat"
    own_rows = "adaptive tokens"  # what the rows after the tree are (show.py)
    floor = 2.4  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, delta: Delta | None, k: int = 5, width: int = 1, ids: list[int] | None = None):
        if k < 1 or width < 1:
            raise NanospecError(f"sdsat k={k}, width={width}: both must be at least 1")
        n = len(ids) if delta is None else len(delta.embed)
        if 1 < n < k:
            raise NanospecError(f"sdsat k={k}: this drafter was trained with {n} diverse adaptive tokens; use k <= {n}")
        self.delta, self.k, self.width = delta, k, width
        self.factors = None if delta is None else [{m: (a.detach().contiguous(), b.detach().contiguous())
                                                    for m, (a, b) in f.items()} for f in delta.factors()]
        self.ids = None if ids is None else (ids * k if n == 1 else ids[:k])  # identical or diverse tokens
        self.allowed_paths = [(0,) * d + (j,) for d in range(k) for j in range(width)]  # top-1s have children
        self.template = Template(self.allowed_paths)
        self.topk = self.template.topk
        self.ahead = k  # adaptive tokens: k, or a planner's budget's worth (Ranked.own_depths)
        self.max_rows = self.rows(len(self.template))
        self.verifying = self.drafts = self.drafts_accepted = self.draft_only = 0  # statistics for report()

    @classmethod
    def load(cls, model, weights, k=5, width=1) -> "SDSAT":
        return cls(load_delta(model, weights)[0], k, width)

    @classmethod
    def random(cls, model, seed=0) -> "SDSAT":
        """A noisy update of rank 4 and one adaptive token; 4 of them drafted, 2 candidates each."""
        return cls(noisy(Delta(model, 4), seed, 0.3).to(model.embed.weight), k=4, width=2)

    def rows(self, n, budget=None):
        return n + self.own_depths(budget)

    def draft(self, dec, cands, template, budget) -> Tree:
        if cands is None:  # draft step 1: the last token alone; k adaptive rows after it draft k tokens
            return Tree.chain(dec.root)
        return template.tree(dec.root, cands)  # draft step 2: the next token, then the k drafts (a chain, or a tree)

    def groups(self, tree, n, budget=None):
        """The adaptive rows after the top-1 chain (step 1: the root): sdsat_full's ids, or rows the forward embeds."""
        k = self.own_depths(budget)
        return Groups((chain_end(tree.parents),), k, tokens=() if self.ids is None else tuple(self.ids[:k]))

    def forward(self, f, nodes):
        """Either step's forward: the tree's rows, verified (eq. 3), then k adaptive rows, whose logits draft for a
        path that ends at the top-1 chain's end (the next step is a step 2) and no other (the next is a step 1)."""
        n, k, N = nodes.largest, nodes.M, nodes.N
        adaptive = slice(n, n + k)
        x, update = f.embed(), None  # sdsat_full: the rows hold a fine-tuned model's own adaptive ids
        if self.delta is not None:
            e = self.delta.embed  # one adaptive token repeated, or the first k diverse ones
            x[:, adaptive] = (e.expand(k, -1) if len(e) == 1 else e[:k]).to(x.dtype)
            update = self.delta.on(adaptive, self.factors)
        logits = f.logits(f.norm(f.layers(x, delta=update)), max(N, n + k))  # all rows': one pass of the head
        depth = nodes.lay.depth[:, :n].masked_fill(~nodes.real[:, :n], -1)
        ends = depth.argmax(-1, keepdim=True)  # each chain's end: its tree's first deepest node
        drafted = torch.where(torch.arange(N, device=x.device) == ends, k, 0)  # drafts per node: k there, else none
        return Out(logits[:, :N], draft_inputs=logits[:, None, adaptive].expand(-1, N, -1, -1), depths=drafted)

    def accepted(self, dec, tree, path):
        self.draft_only += len(tree) == 1 and dec.cands is not None  # a draft step 1: k drafted (an AR step: none)
        self.verifying += len(tree) > 1
        self.drafts += len(tree) - 1
        self.drafts_accepted += len(path) - 1

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


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    p.add_argument("--window", type=int, default=5, help="L: the longest run of adaptive tokens")
    p.add_argument("--mask-rate", type=float, default=0.1, help="chance that a position starts a window")
    p.add_argument("--diverse", action="store_true", help="a different adaptive token per window position")
    p.add_argument("--rank", type=int, default=8, help="r of the update (8: a few MB on SmolLM2)")
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
            which[b, r:r + n], pos[b, r:r + n] = j if diverse else 0, s + j
            vis[b, r:r + n, :T] = torch.arange(T) < s
            vis[b, r:r + n, T + r:T + r + n] = j[None] <= j[:, None]
            lab[b, r:r + n] = after[b, s + j + 1] if ahead is None else ahead[b, s - 1, :n]
            r += n
    return which, pos, vis, lab


def adaptive_logits(model, delta: Delta, x: torch.Tensor, wins, diverse: bool, ahead=None):
    """Logits (B, R, V) of the adaptive rows of windows `wins` over x (B, T), and their labels (adaptive_rows). The
    rows read the frozen model's keys and values over x, computed first without gradients."""
    (B, T), device = x.shape, x.device
    with torch.no_grad():
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
        f = Forward.training(model, x, torch.arange(T, device=device).expand(B, T), causal)
        keys = f.kv  # the buffers each layer writes its keys and values into
        h = f.embed()
        for layer, kv in zip(model.layers, keys):
            h = layer(h, f.ctx, kv)
    which, pos, vis, lab = (t.to(device) for t in adaptive_rows(x.cpu(), wins, diverse, ahead))
    f = Forward.training(model, torch.zeros_like(pos), pos, vis, before=keys)
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
    save_drafter(Path(args.out) / "sdsat.safetensors", delta, meta)
    print(f"wrote {Path(args.out) / 'sdsat.safetensors'}")
