"""Medusa-1 heads (Cai et al., 2024): the base ProPD builds on (its section 2; propd.py cites it) and the baseline
BiTA and Hidden Transfer are measured against.

Spec: Tianle Cai, Yuhong Li, Zhengyang Geng, Hongwu Peng, Jason D. Lee, Deming Chen, Tri Dao, "Medusa: Simple LLM
Inference Acceleration Framework with Multiple Decoding Heads", 2024, arXiv:2401.10774.

K heads read the base model's final (normed) hidden state h of a token x_t. The lm_head gives x_{t+1}; head k guesses
x_{t+1+k}. Head k is a residual SiLU block, h + SiLU(W_k h + b_k) with W_k and b_k zero-initialised (or a stack of
such blocks: Medusa's own code takes the number of layers per head as an option), then its own vocabulary projection
initialised from the lm_head, so an untrained head repeats the next-token guess. The base model is frozen.

Each step verifies a sparse static tree of head candidates with the core engine. The same forward yields h for every
tree node, and the heads on the last accepted node give the next step's candidates: drafting costs no extra forward.

Choices where the papers are silent, and why:
- Head k's loss is weighted 0.8^(k-1), Medusa's decay: later heads are less accurate and should not dominate the
  shared gradient scale.
- Targets are hard labels: the model's own greedy continuations (self-distillation), which are exactly what greedy
  verification accepts; with --forced, also teacher-forced windows of real text, where a target is the model's own
  token wherever the text went on as the model would up to it (training/forced.py).
- The tree comes from measured accuracies: acc[k][r] is how often head k's rank-r candidate is right on held-out
  data. Greedy expansion adds the path with the highest product of accuracies whose parent is already in the tree
  (Medusa's sparse trees), up to tree_size nodes.
- Vocabulary projection: each head's own (the paper's; the default model's shipped heads) or, with --shared-head, the
  model's frozen lm_head shared by all heads (EAGLE's choice), which the SmolLM2 heads use: an own projection there
  is as large as the lm_head, per head. Sharing costs a little accuracy and acceptance for a far smaller file
  (RESULTS.md, "Medusa").
- A generation's first step has no hidden state yet for the prompt's last token, so it drafts nothing (the root
  alone).

One option is not Medusa-1's. With --token-input head k reads h + T_k e, e the embedding of
x_{t+1}, the token the lm_head picks from h, and T_k a zero-initialised linear map. Under greedy decoding x_{t+1} is
known when the heads run: it is the next tree's root, the token the verifying forward just emitted. A head that reads
h alone has to recover that token, an argmax over the vocabulary, with a few small blocks; handed the token, every
head is more often right (RESULTS.md, "SmolLM2 drafters"). Hydra (Ankner et al., 2024) and EAGLE feed drafted
tokens back in the same way; this reads only the token that is certain, so the tree and its verification stay
Medusa's, and the heads cost one gather and one small map more. Under sampling the emitted root is drawn, not the
argmax: the heads still read the argmax, which can cost acceptance, never exactness.

Another option is not Medusa-1's. With --draft-vocab N shared heads draft only the N tokens their
training targets use most, as FR-Spec (Zhao et al., 2025) does for EAGLE's head: at a few rows the heads' product
reads the whole lm_head, drafting's largest cost at a large vocabulary on a CPU, while a model's own continuations
use a small part of its tokens. The rows of those tokens are copied out once (Heads.narrowed) and every other token's
logit is -inf, so it is never a candidate; the trainer measures its accuracies the same way. Verification reads the
model's logits alone, so the output stays AR's.

What runs where: the forward, greedy verification and the heads on the last accepted node (then their top-k) are one
device program, a CUDA graph in exact mode on a GPU; the host reads back the accepted path and the candidates, and
the tree's shape is laid out once (tree.Template).
"""
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..drafter import RANDOM_ACC, Borrowed, Out, Ranked, noisy, plain
from ..io.checkpoint import load_trained, save_drafter
from ..io.files import fingerprint
from ..training.data import distill_args
from ..training.forced import labelled, targets, training_items
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, hidden_states, update
from ..tree import Template, choose_tree


class Heads(nn.Module):
    """K heads, each with its own vocabulary projection or (shared=lm_head) all on the model's frozen lm_head (the
    header's --shared-head); base=model (--token-input): each also reads the embedding of the token it emits after h."""

    def __init__(self, dim: int, vocab: int, K: int, shared: nn.Linear | None = None, layers: int = 1,
                 base: nn.Module | None = None, draft_vocab: int = 0):
        super().__init__()
        self.K, self.layers = K, layers
        self.res = nn.ModuleList(nn.Linear(dim, dim) for _ in range(K * layers))  # head k's blocks: k*layers, ...
        self.tok = None if base is None else nn.ModuleList(nn.Linear(dim, dim) for _ in range(K))
        self.proj = None if shared else nn.ModuleList(nn.Linear(dim, vocab, bias=False) for _ in range(K))
        self.shared, self.base = Borrowed([shared]), Borrowed([base])  # the model's: not trained, saved or copied
        # the token ids a shared head may draft (the header's --draft-vocab), ascending; None: all of them
        self.register_buffer("vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    def init_from(self, lm_head: nn.Linear) -> "Heads":
        with torch.no_grad():
            for r in [*self.res, *(self.tok or [])]:
                r.weight.zero_()
                r.bias.zero_()
            for p in self.proj or []:
                p.weight.copy_(lm_head.weight)
        return self

    @torch.no_grad()
    def next_tokens(self, h, batch: int = 4096) -> torch.Tensor:
        """(N, D) -> (N,): the token the model emits after each state (its lm_head's argmax)."""
        return torch.cat([self.base[0].lm_head(h[i:i + batch]).argmax(-1) for i in range(0, len(h), batch)])

    def states(self, h, e=None):  # h (..., D) -> (K, ..., D); e: token heads' next-token embeddings (None: computed)
        if self.tok is not None and e is None:
            e = self.base[0].embed(self.next_tokens(h.reshape(-1, h.shape[-1]))).view_as(h)
        x = []
        for k in range(self.K):
            y = h if self.tok is None else h + self.tok[k](e)
            for r in self.res[k * self.layers:(k + 1) * self.layers]:
                y = y + F.silu(r(y))
            x.append(y)
        return torch.stack(x)

    def forward(self, h, e=None, linear=plain, narrow: nn.Linear | None = None):
        """(..., D) -> (K, ..., V): every head's logits. linear(proj, x): the products' form (propose: the device's).
        narrow (Heads.narrowed): only the draft vocabulary's tokens scored, the others -inf."""
        x = self.states(h, e)
        if narrow is not None:
            out = x.new_full((*x.shape[:-1], self.shared[0].weight.shape[0]), -math.inf)
            return out.index_copy_(-1, self.vocab, linear(narrow, x))
        if self.proj is None:
            return linear(self.shared[0], x)  # one product for all heads
        return torch.stack([linear(p, y) for p, y in zip(self.proj, x)])

    def narrowed(self) -> nn.Linear | None:
        """The shared lm_head's rows of the draft vocabulary, as a product of their own (None: no draft vocabulary)."""
        if self.vocab is None:
            return None
        w = self.shared[0].weight
        proj = nn.Linear(w.shape[1], len(self.vocab), bias=False, device=w.device, dtype=w.dtype)
        proj.weight = nn.Parameter(w.detach()[self.vocab], requires_grad=False)
        return proj


class Medusa(Ranked):
    name = "medusa"
    floor = 2.8  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, heads: Heads, paths: list[tuple[int, ...]], acc: list[list[float]] | None = None):
        self.heads, self.acc = heads, acc  # acc: held-out accuracy per head and rank (the planner's prior)
        self.template = Template(paths)
        self.max_rows, self.topk = len(self.template), self.template.topk
        self.narrow = heads.narrowed()  # the draft vocabulary's product, whose form a device's forms may pick

    @classmethod
    def load(cls, model, weights, tree_size=0) -> "Medusa":
        heads, meta = load_heads(model, weights)
        return cls(heads, choose_tree(meta["acc"], tree_size) if tree_size else meta["tree"], meta["acc"])

    @classmethod
    def random(cls, model, seed=0) -> "Medusa":
        """Noisy token heads on the shared lm_head, drafting from a random draft vocabulary of most of its tokens
        (--shared-head --token-input --draft-vocab): every part of the heads runs."""
        a = model.args
        heads = Heads(a.dim, a.vocab_size, 3, model.lm_head, base=model, draft_vocab=max(1, a.vocab_size * 3 // 4))
        heads.vocab.copy_(torch.randperm(a.vocab_size, generator=torch.Generator().manual_seed(seed))[:len(heads.vocab)]
                          .sort().values)
        return cls(noisy(heads.init_from(model.lm_head), seed, 0.1).to(model.embed.weight), choose_tree(RANDOM_ACC, 12))

    def forward(self, f, nodes):
        """One forward verifies the tree and gives every node's final state h: the heads' input."""
        return self.out(f, f.norm(f.layers(f.embed())), nodes.N)

    def out(self, f, h, N: int) -> Out:
        """The nodes' logits and drafts: each node's h and, for token heads, the embedding of the token
        the node emits next (its logits' argmax: the next tree's root, were the path to end there)."""
        logits = f.logits(h, N)
        if self.heads.tok is None:
            return Out(logits, draft_inputs=h[:, :N, None])
        return Out(logits, draft_inputs=torch.stack([h[:, :N], f.model.embed(logits.argmax(-1))], 2))

    def propose(self, draft_inputs, linear=plain):  # (B, K, V): head k guesses the token k+1 after the next
        return self.heads(*draft_inputs.unbind(1), linear=linear, narrow=self.narrow).transpose(0, 1)


# --- weights on disk ---------------------------------------------------------------------------
def load_heads(model, weights):
    a = model.args
    return load_trained(model, Path(weights) / "medusa.safetensors", "python train.py --method medusa",
                        lambda meta: Heads(a.dim, a.vocab_size, meta["heads"],
                                           model.lm_head if meta.get("shared") else None, meta.get("layers", 1),
                                           model if meta.get("token") else None, meta.get("draft_vocab", 0)))


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    distill_args(p)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--shared-head", action="store_true", help="the heads share the frozen lm_head (EAGLE's choice)")
    p.add_argument("--head-layers", type=int, default=1, help="residual SiLU blocks per head")
    p.add_argument("--token-input", action="store_true",
                   help="each head also reads the embedding of the token the model emits next (not Medusa-1's)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="with --shared-head: the heads draft only the N tokens their training targets use most "
                   "(0: the whole vocabulary)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=1024, help="positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tree-size", type=int, default=24, help="draft nodes of the static tree")
    p.add_argument("--topk", type=int, default=10, help="ranks per head the tree may use")


def samples(model, items, K: int):
    """(h_t, targets (K,)) for every position where one of the model's own next K tokens is known (forced.targets;
    -100: not known) over (tokens, labels) items."""
    hs, tg = [], []
    for (tokens, labels), h in zip(items, hidden_states(model, [t for t, _ in items])):
        y = targets(tokens, labels, K)
        keep = (y >= 0).any(1)
        hs.append(h[keep.to(h.device)])
        tg.append(y[keep].to(h.device))
    return torch.cat(hs), torch.cat(tg)


def loss_fn(logits, targets):  # logits (K, N, V), targets (N, K)
    return sum(0.8 ** k * F.cross_entropy(x, targets[:, k], ignore_index=-100) for k, x in enumerate(logits))


def draft_vocab(targets, n: int, vocab: int) -> torch.Tensor:
    """The n token ids the targets (-100: none) use most, ascending; ties and unseen tokens go to the lowest
    ids (a BPE vocabulary numbers its merges from its corpus's most frequent)."""
    count = torch.bincount(targets[targets >= 0].flatten(), minlength=vocab)
    return (torch.arange(vocab, device=count.device) - count * vocab).argsort()[:n].sort().values


@torch.no_grad()
def accuracy(heads, h, targets, topk: int, batch: int = 4096) -> list[list[float]]:
    """acc[k][r]: how often head k's rank-r candidate is the target, on held-out positions (the candidates
    decoding drafts: within the draft vocabulary, if any)."""
    acc, narrow = RankAccuracy(targets.shape[1], topk), heads.narrowed()
    for i in range(0, len(h), batch):
        acc.add(heads(h[i:i + batch], narrow=narrow).transpose(0, 1), targets[i:i + batch])
    return acc.result()


def train(args):
    if args.head_layers < 1:
        raise NanospecError(f"--head-layers must be at least 1, not {args.head_layers}")
    if args.draft_vocab and not args.shared_head:
        raise NanospecError("--draft-vocab narrows the shared lm_head: it needs --shared-head")
    if args.draft_vocab < 0:
        raise NanospecError(f"--draft-vocab must be 0 (the whole vocabulary) or a token count, not {args.draft_vocab}")
    out = Path(args.out)
    model, train_data, held = distilled(args)  # held out: for accuracies and the tree
    if args.draft_vocab > model.args.vocab_size:
        raise NanospecError(f"--draft-vocab {args.draft_vocab} exceeds the model's {model.args.vocab_size} tokens")
    t0 = time.time()
    h_tr, y_tr = samples(model, training_items(model, args, train_data), args.heads)
    h_ev, y_ev = samples(model, [labelled(d) for d in held], args.heads)
    print(f"medusa: {len(h_tr):,} training positions, {len(h_ev):,} held out "
          f"(hidden states in {time.time() - t0:.0f}s)", flush=True)

    torch.manual_seed(args.seed)
    a = model.args
    heads = Heads(a.dim, a.vocab_size, args.heads, model.lm_head if args.shared_head else None,
                  args.head_layers, model if args.token_input else None, args.draft_vocab).init_from(model.lm_head)
    heads.to(model.embed.weight.device)
    if args.draft_vocab:
        heads.vocab.copy_(draft_vocab(y_tr, args.draft_vocab, a.vocab_size))
    nxt = heads.next_tokens(h_tr) if args.token_input else None  # token heads' second input, once
    opt = adamw(heads, args.lr, weight_decay=0.0)
    steps = math.ceil(args.epochs * len(h_tr) / args.batch_size)
    ckpt = Checkpoint(args, f"medusa-{fingerprint(model)}", heads, opt)
    prog = ckpt.progress(steps, every=20)
    order = {}
    for step in ckpt.steps():  # an epoch's order comes from (seed, epoch): resumable
        lr = cosine_lr(step, ckpt.total, args.lr, warmup=min(50, steps // 10 + 1))
        epoch, i = divmod(step * args.batch_size, len(h_tr))
        if epoch not in order:
            g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
            order = {epoch: torch.randperm(len(h_tr), generator=g)}
        idx = order[epoch][i:i + args.batch_size]
        loss = loss_fn(heads(h_tr[idx], None if nxt is None else model.embed(nxt[idx])), y_tr[idx])
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, len(idx))

    acc = accuracy(heads, h_ev, y_ev, args.topk)
    for k, a in enumerate(acc, 1):
        print(f"head {k} (token t+{k + 1}): held-out top-1 {a[0]:.3f}, top-5 {sum(a[:5]):.3f}")
    tree = choose_tree(acc, args.tree_size)
    meta = {"base_fingerprint": fingerprint(model), "heads": args.heads, "shared": args.shared_head,
            "layers": args.head_layers, "token": args.token_input, "draft_vocab": args.draft_vocab, "acc": acc,
            "tree": tree, "trained": {"positions": len(h_tr), "forced": args.forced} | ckpt.record()}
    save_drafter(out / "medusa.safetensors", heads, meta)
    print(f"wrote {out / 'medusa.safetensors'}: {args.heads} heads, tree of {len(tree)} nodes")
