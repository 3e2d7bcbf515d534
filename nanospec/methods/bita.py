"""BiTA (Lin et al., 2024): bi-directional tuning, and generation + verification in one forward.

Spec: Feng Lin, Hanling Yi, Hongbin Li, Yifan Yang, Xiaotian Yu, Guangming Lu, Rong Xiao, "BiTA: Bi-Directional
Tuning for Lossless Acceleration in Large Language Models", 2024, arXiv:2401.12522 (section 3, Figures 3-6 and 10,
Algorithm 1, Tables 3-4, appendix A).

The frozen model gains M learnable mask-token embeddings and P learnable prompt tokens. Mask tokens appended after a
token predict the tokens beyond its next one; prompt tokens are seen by mask tokens only (Figure 3), so ordinary tokens
compute exactly what the base model computes. Each step runs one forward over the draft tree of the previous step's mask
predictions plus a group of M mask tokens attached to every tree node (and the root): the tree is verified, and the
group attached to the last accepted node drafts the next tree (Figure 10, Algorithm 1).

Decoding variants (Table 4): `efficient` (default; top-k candidates per mask token, only the top-1 candidate of each
depth has children, Figure 5), `full` (every top-k candidate has children: the product tree), `straight`
(straightforward decoding, Figure 4: the top-1 chain and one mask group on the root, which sees no draft token).
Prompting (Table 3): `deep` (default; prefix tuning: learned keys and values in every layer), `shallow` (learned input
embeddings that run through the model as P rows before the first step), `none` (masks only).

Choices where the paper is silent, and why:
- Indexing: a node's own logits give the token after it (the AR output); mask i (0-based) of the group attached to a
  node at position p sits at position p+1+i and predicts the token at p+2+i, as in decoding's "the model outputs y_N and
  M future predictions y_N+1..y_N+M". Training labels follow the same rule (eq. 1 with that offset).
- Deep prompt keys carry no rotary position (prefix tuning stores rotated keys; these are learned directly). Rotating
  them as if at positions 0..P-1 trains to the same loss (RESULTS.md, "BiTA"), so the simpler form is the one here.
  Shallow prompt rows sit at 0..P-1 and see each other causally.
- Straightforward decoding: after c accepted drafts, the root group's masks c.. give the next drafts (the first c are
  "discarded"); with c = M there are none (the paper's "even zero").
- Training packs `groups` mask groups per sequence at random split points of the answer (the authors pack many per
  sample); the loss is eq. 1 summed over the M masks, averaged over groups. Init N(0, 0.02); AdamW; cosine schedule from
  3e-2, the paper's rate. A mask's label is the model's own token (self-distillation; with --forced, teacher-forced real
  text where the text went on as the model would: training/forced.py).
- Straightforward decoding's drafts per node: a node at depth c of the root's chain drafts from the root group's masks
  c.., so the step's one group serves whichever node ends the path.
- Under a planner (fast mode's default), a group holds min(M, budget) masks, the first ones: the next tree is at most
  budget deep (drafter.Ranked). A mask sees only the masks before it, so the first ones draft as in a full group.
  Straightforward decoding keeps M: its root group serves the chain's every depth.

What runs where: the step's rows (tree and mask groups), one lm_head product over the tree's and the masks' rows (the
head's weights read once a step), and verification are one device program (a CUDA graph per tree size in exact mode on a
GPU); copying the deep prompt keys into their reserved slots runs eagerly, once per generation. The trainer's packed
forward runs the same layers over the core's Forward (`Forward.training`).
"""
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..cache import Block
from ..drafter import Out, Ranked, noisy
from ..forward import Forward
from ..io.checkpoint import load_trained, save_drafter
from ..io.files import fingerprint
from ..training.data import distill_args
from ..training.forced import labelled, start, targets, training_items
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, update
from ..tree import Groups, Template, product_paths

PROMPTING = ("deep", "shallow", "none")
DECODING = ("efficient", "full", "straight")


class Tuning(nn.Module):
    """The trainable embeddings: M mask tokens and P prompt tokens."""

    def __init__(self, args, masks: int = 3, prompts: int = 16, prompting: str = "deep"):
        super().__init__()
        self.prompting, self.P = prompting, prompts if prompting != "none" else 0
        self.mask = nn.Parameter(torch.randn(masks, args.dim) * 0.02)
        if prompting == "deep":  # per layer and KV head: P keys and values
            shape = (args.n_layers, args.kv_heads, self.P, args.hd)
            self.key = nn.Parameter(torch.randn(shape) * 0.02)
            self.value = nn.Parameter(torch.randn(shape) * 0.02)
        elif prompting == "shallow":
            self.prompt = nn.Parameter(torch.randn(self.P, args.dim) * 0.02)

    @property
    def M(self) -> int:
        return self.mask.shape[0]


# --- decoding ----------------------------------------------------------------------------------

class BiTA(Ranked):
    name = "bita"
    own_rows = "mask tokens"  # what the rows after the tree are (show.py)
    floor = 2.3  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, tune: Tuning, decoding: str = "efficient", k: int = 3):
        if decoding not in DECODING:
            raise NanospecError(f"bita decoding {decoding!r}: choose from {', '.join(DECODING)}")
        if k < 1:
            raise NanospecError(f"bita k={k}: take at least the top-1 candidate per mask token")
        self.tune, self.decoding, M = tune, decoding, tune.M
        self.reserved_slots = tune.P
        paths = {"efficient": [(0,) * d + (j,) for d in range(M) for j in range(k)],  # top-1s have children
                 "full": product_paths([k] * M), "straight": [(0,) * d for d in range(1, M + 1)]}[decoding]
        self.template, self.allowed_paths = Template(paths), paths  # a planned tree keeps the variant's shape
        self.topk = self.template.topk
        self.ahead = M  # masks per group: M, or a planner's budget's worth (Ranked.own_depths)
        self.max_rows = self.rows(len(self.template))

    @classmethod
    def load(cls, model, weights, decoding="efficient", k=3, prompting="deep") -> "BiTA":
        if prompting not in PROMPTING:
            raise NanospecError(f"bita prompting {prompting!r}: choose from {', '.join(PROMPTING)}")
        cmd = "python train.py --method bita" + ("" if prompting == "deep" else f" --prompting {prompting}")
        tune, _ = load_trained(model, Path(weights) / filename(prompting), cmd,
                               lambda meta: Tuning(model.args, meta["masks"], meta["prompts"], prompting))
        return cls(tune, decoding, k)

    @classmethod
    def random(cls, model, seed=0) -> "BiTA":
        """Noisy embeddings; the seed picks the variant: deep prompts and efficient trees, shallow prompts and
        full trees, or no prompts and the straightforward chain."""
        prompting, decoding, masks, prompts, k = [("deep", "efficient", 3, 4, 2), ("shallow", "full", 2, 3, 2),
                                                  ("none", "straight", 3, 4, 1)][seed % 3]
        tune = noisy(Tuning(model.args, masks, prompts, prompting), seed, 1.0).to(model.embed.weight)
        return cls(tune, decoding, k)

    def hosts(self, n: int) -> int:
        return 1 if self.decoding == "straight" else n  # mask groups: on the root, or on every node

    def masks(self, budget=None) -> int:
        """Masks per group: straightforward decoding's root group serves every depth of the chain, so all M."""
        return self.tune.M if self.decoding == "straight" else self.own_depths(budget)

    def rows(self, n, budget=None):
        return n + self.hosts(n) * self.masks(budget)

    def start(self, dec):
        """The prompt's keys and values into the reserved slots: deep, as trained, in every layer; shallow, those
        its P rows compute, causal among themselves from position 0."""
        slots, P = torch.tensor(dec.reserved), len(dec.reserved)
        if self.tune.prompting == "deep":
            dec.cache.write_reserved(dec.cache_row, slots, self.tune.key, self.tune.value)
        elif self.tune.prompting == "shallow":
            extra = torch.where(torch.arange(P)[None] <= torch.arange(P)[:, None], slots[None], -1)
            z = torch.zeros(1, P, dtype=torch.long)
            dec.run(Block(z, torch.arange(P)[None], slots, z, extra[None]), embeds=self.tune.prompt[None])

    def groups(self, tree, n, budget=None):
        return Groups(tuple(range(self.hosts(n))), self.masks(budget), sees_reserved=True)

    def forward(self, f, nodes):
        """One forward: the tree (verified) and a mask group on each node (or the root) that drafts next."""
        n, M, N = nodes.largest, nodes.M, nodes.N
        G = self.hosts(n)
        x = f.embed()
        x[:, n:n + G * M] = self.tune.mask[:M].to(x.dtype).repeat(G, 1)
        h = f.norm(f.layers(x))
        logits = f.logits(h, max(N, n + G * M))  # the tree's and the masks' in one product: one pass of the head
        masks = logits[:, n:n + G * M].view(len(h), G, M, -1)  # mask i predicts the token i+1 after the next one
        if self.decoding == "straight":  # a node at depth c drafts from the root group's masks c..
            depth = nodes.lay.depth  # (B, N)
            i = (depth[..., None] + torch.arange(M, device=depth.device)).clamp(max=M - 1)
            drafts = masks[torch.arange(len(h), device=h.device)[:, None, None], 0, i]
            return Out(logits[:, :N], draft_inputs=drafts, depths=(M - depth).clamp(min=0))
        return Out(logits[:, :N], draft_inputs=masks)


# --- weights on disk ---------------------------------------------------------------------------
def filename(prompting: str) -> str:
    return "bita.safetensors" if prompting == "deep" else f"bita-{prompting}.safetensors"


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    distill_args(p)
    p.add_argument("--masks", type=int, default=3, help="mask tokens M")
    p.add_argument("--prompts", type=int, default=16, help="prompt tokens P")
    p.add_argument("--prompting", default="deep", choices=PROMPTING)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--groups", type=int, default=32, help="mask groups per sequence")
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--piece", type=int, default=128, help="tokens per training sequence of the --forced data")


def pack(items: list, M: int, G: int, P: int, shallow: bool, gen, device="cpu"):
    """A packed SAR batch of (tokens, labels) items: each sequence's ordinary rows, then G mask groups at random
    split points k from its first labelled position on (a distilled pair's last prompt token). Keys are [P prompt |
    rows]; with shallow prompting the P prompt rows lead the rows. Mask i of a group at k is labelled with the model's
    own token k+2+i where it is known (training/forced.py). Returns (tokens, kind, pos, vis, labels): kind is 0 for
    ordinary rows, 1+i for mask i, -1-j for prompt row j; labels (B, G*M) hold -100 where there is nothing to
    predict."""
    T = max(len(s) for s, _ in items)
    pr = P if shallow else 0          # prompt rows
    K0 = P                            # the first ordinary row's key
    key = torch.arange(K0 + T + G * M)[None]
    g, i = torch.arange(G).repeat_interleave(M), torch.arange(M).repeat(G)
    t, j = torch.arange(T), torch.arange(pr)
    out = []
    for s, labels in items:
        lo, hi = start(labels) - 1, len(s) - 3  # mask 0 of a group at k predicts token k+2
        ks = (lo + torch.randperm(max(hi - lo + 1, 0), generator=gen)[:G]).tolist()
        n_valid = len(ks)
        k = torch.tensor(ks + [0] * (G - n_valid))[g]  # groups beyond n_valid are padding
        first = K0 + T + g[:, None] * M
        vis = torch.cat([
            key <= j[:, None],                                                    # prompt rows: causal
            (key >= K0) & (key <= K0 + t[:, None]),                               # ordinary rows: causal
            (key < K0) | ((key >= K0) & (key <= K0 + k[:, None])) | ((key >= first) & (key <= first + i[:, None])),
        ])
        lab = targets(s, labels, M)[k, i]
        lab[g >= n_valid] = -100
        out.append((torch.tensor([0] * pr + s + [0] * (T - len(s) + G * M)),
                    torch.cat([-1 - j, torch.zeros(T, dtype=torch.long), 1 + i]),
                    torch.cat([j, t, k + 1 + i]), vis, lab))
    return tuple(torch.stack(x).to(device) for x in zip(*out))  # made on the host, used on device


def sar_logits(model, tune: Tuning, tokens, kind, pos, vis):
    """Logits (B, G*M, V) of the mask rows of a packed batch; cache-free, the model frozen."""
    deep = tune.prompting == "deep"  # the prompt's keys and values sit before the rows in every layer
    prompt = (lambda i: torch.stack((tune.key[i], tune.value[i]))[:, None]) if deep else None
    f = Forward.training(model, tokens, pos, vis, prompt)
    x = torch.where((kind >= 1)[..., None], tune.mask[(kind - 1).clamp(min=0)], f.embed())
    if tune.prompting == "shallow":
        x = torch.where((kind < 0)[..., None], tune.prompt[(-1 - kind).clamp(min=0)], x)
    n_mask = int((kind[0] >= 1).sum())  # the mask rows come last
    return model.lm_head(f.norm(f.layers(x))[:, -n_mask:])


def sar_loss(logits, labels, M: int):
    """Eq. 1: cross-entropy summed over the M masks of a group, averaged over groups."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) * M


def batches(items, args, P, shallow, gen, steps, device="cpu"):
    for step in range(steps):
        idx = torch.randint(0, len(items), (args.batch_size,), generator=gen).tolist()
        yield pack([items[i] for i in idx], args.masks, args.groups, P, shallow, gen, device)


@torch.no_grad()
def accuracy(model, tune, data, args, topk: int = 5) -> list[list[float]]:
    """acc[i][r]: how often mask i's rank-r candidate is the target, over every held-out sequence once (its split
    points drawn with a fixed seed, so two drafters are measured at the same ones)."""
    acc, gen = RankAccuracy(tune.M, topk), torch.Generator().manual_seed(1)
    for at in range(0, len(data), args.batch_size):
        tokens, kind, pos, vis, lab = pack(data[at:at + args.batch_size], tune.M, args.groups, tune.P,
                                           tune.prompting == "shallow", gen, model.embed.weight.device)
        logits = sar_logits(model, tune, tokens, kind, pos, vis)  # (B, G*M, V)
        acc.add(logits.view(len(lab), -1, tune.M, logits.shape[-1]), lab.view(len(lab), -1, tune.M))
    return acc.result()


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)
    train_items, held = training_items(model, args, train_data, piece=args.piece), [labelled(d) for d in held]
    points = sum(max(len(t) - start(lab) - 1, 0) for t, lab in train_items)
    print(f"bita: {len(train_items):,} training sequences, {points:,} split points", flush=True)
    torch.manual_seed(args.seed)
    tune = Tuning(model.args, args.masks, args.prompts, args.prompting).to(model.embed.weight.device)
    opt = adamw(tune, args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = Checkpoint(args, f"bita-{args.prompting}-{fingerprint(model)}", tune, opt, [gen], every=20)
    prog = ckpt.progress(args.steps, every=10)
    shallow = args.prompting == "shallow"
    data = batches(train_items, args, tune.P, shallow, gen, args.steps - ckpt.start, model.embed.weight.device)
    for step, (tokens, kind, pos, vis, lab) in zip(ckpt.steps(), data):
        lr = cosine_lr(step, ckpt.total, args.lr, warmup=min(20, args.steps // 10 + 1))
        loss = sar_loss(sar_logits(model, tune, tokens, kind, pos, vis), lab, tune.M)
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, int(tokens.numel()))
    acc = accuracy(model, tune, held, args)
    for i, a in enumerate(acc):
        print(f"mask {i + 1} (token t+{i + 2}): held-out top-1 {a[0]:.3f}, top-5 {sum(a):.3f}")
    meta = {"base_fingerprint": fingerprint(model), "masks": args.masks, "prompts": args.prompts,
            "prompting": args.prompting, "acc": acc,
            "trained": {"positions": points, "forced": args.forced} | ckpt.record()}
    save_drafter(out / filename(args.prompting), tune, meta)
    print(f"wrote {out / filename(args.prompting)}")
