"""ProPD (Zhong et al., 2024): early tree pruning and a dynamic tree size on top of Medusa heads.

Spec: Shuzhang Zhong, Zebin Yang, Meng Li, Ruihao Gong, Runsheng Wang, Ru Huang, "ProPD: Dynamic Token Tree
Pruning and Generation for LLM Parallel Decoding", 2024, arXiv:2402.13485 (sections 3-4, Tables 2-3). Medusa
(medusa.py) supplies the heads and the candidate tree; this file adds what is ProPD's own.

Early pruning (4.1): an early prediction head reads the residual stream after layer n; there, in the verification
forward, every tree node whose token is not in the top-k of its parent's early prediction is pruned with its
descendants, and layers n+1.. run on the survivors (the core's Forward: fast mode removes rows and slices the attention
context, the paper's cached masks; exact mode runs each row at a fixed shape and the pruned just leave verification, as
a row's result never depends on the others).

Dynamic token tree generation (4.2), with the core's planner (planner.py): the cost model of iteration time, per-head
acceptance EMAs p[i][k], the expected acceptance length of a tree (Figure 6) and the size it picks, the one maximising
expected length per second; the tree of that size is Medusa's greedy expansion under the tracked p.

Choices where the paper is silent, and why:
- The early head: a zero-initialised residual SiLU block, an RMSNorm (from the final norm) and a rank-64 vocabulary
  projection initialised from the lm_head's truncated SVD. The paper trains "their own heads" for early layers
  (Figure 3a), only to rule tokens out (top-k, not top-1). A full-rank projection costs an lm_head every step, at batch
  size 1 as much as pruning saves; rank 64 costs a fraction and, trained, ranks the early tokens better than the frozen
  lm_head (RESULTS.md, "ProPD"). They fit the base model's own next token after each of --early-layers (`train.py
  --method medusa` after the Medusa heads, or `--method propd` alone; --forced: teacher-forced real text too).
- Iteration time is wall time from one draft to the next (forward, verification, commit, drafting), keyed by the
  tree's size before pruning: pruning shows as cheaper large trees, how the two techniques combine (section 5.4.3).
- Candidate budgets: the paper names none: the core planner's (1, 3, 7, ..., 63: with the root, powers of two rows),
  or a device layer's (a CPU's: one under each of fast mode's row buckets, tuning/probing.own_budgets).
- Until two budgets are measured the planner explores: the static tree's size, then the smallest. Each generation's
  first step, one AR row (no hidden state yet), is not timed: a single row takes a faster matrix-vector path on CPU.
- Whose costs: the paper's online line (`planner=online`) cannot price that AR row, so it never steps aside, and in
  a batch on a CPU it loses to AR. By default (`measured`) a device layer hands ProPD the core planner on the machine's
  measured prices (decode.py: each live batch size and budget, 0 included); with none, Medusa's tree every step.
- Acceptance starts from the heads' measured held-out accuracies (stored by the trainer) and tracks the top 10 ranks per
  head; a prediction is resolved once its position is emitted. The early head scores every row, not just parents: fixed
  shapes, no host sync.
- The planner picks again every `replan` tokens of its own clock (tokens decoded, not a cursor) and whenever the batch
  changes; the cost model and acceptance EMAs persist across generations (the decoding conditions they estimate do).
- k: the paper's is where acceptance stays close to Medusa's (layer 4, top-50, Table 2). Here, the smallest k whose
  held-out hit rate (the trainer's, for the head's layer) keeps KEEP of the right tokens: top-10 after layer 2 of
  weights/pylm. Where none does, pruning costs more acceptance than its rows save and is off (the report says so), as
  for SmolLM2's CPU-trained head (RESULTS.md, "Why the heuristics stay"). `k=N` prunes at top-N regardless.

What runs where: the forward with its pruning, verification and the heads' candidates are one device program (a CUDA
graph in exact mode on a GPU); planning and acceptance statistics run on the host between steps, on what it reads back.
"""
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import NanospecError
from ..costs import CostModel
from ..drafter import RANDOM_ACC, noisy
from ..io.checkpoint import load_drafter_file, save_drafter
from ..io.files import fingerprint
from ..model import RMSNorm
from ..planner import BUDGETS as CORE_BUDGETS
from ..planner import Planner
from ..training.forced import labelled, targets, training_items
from ..training.loop import Checkpoint, RankAccuracy, adamw, cosine_lr, distilled, hidden_states, update
from ..tree import choose_tree
from ..tuning.measured import Measured
from .medusa import Heads, Medusa, load_heads

BUDGETS = tuple(s for s in CORE_BUDGETS if s)  # the core planner's without 0: ProPD always drafts
KEEP = 0.97  # the share of right tokens the pruning's top-k must keep, held out (see the header)


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


def pruned(nodes, x: torch.Tensor, early: EarlyHead, k: int) -> torch.Tensor:
    """(B, N) bool: nodes to prune given the rows' layer-n states x (B, N, D). A node goes when its
    token is not in the top-k of its parent's early prediction, or when an ancestor goes."""
    logits = early(x)
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # (B, N, k): each row's guesses for its children
    lay = nodes.lay
    parents = top.gather(1, lay.parent.clamp(min=0)[..., None].expand_as(top))  # the root (-1) is no draft
    bad = ~(parents == nodes.tokens[..., None]).any(-1) & (lay.parent >= 0)  # the root is no draft
    anc = lay.anc.clamp(min=0)
    return (bad.gather(1, anc.flatten(1)).view(anc.shape) & (lay.anc >= 0)).any(-1)


# --- the drafter ---------------------------------------------------------------------------------

class ProPD(Medusa):
    """Medusa's heads, verified with early pruning (early=None: off) and a dynamic tree size (dynamic=False: Medusa's
    static tree `paths`) planned from online step times (the paper's; cost=...: another, e.g. measured.Measured)."""
    name = "propd"
    off = None  # why the loader turned pruning off, for the report
    floor = 1.9  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, heads, paths, acc, early: EarlyHead | None = None, layer: int = 2, k: int = 10,
                 dynamic: bool = True, budgets=BUDGETS, replan: int = 32, alpha: float = 0.3, lam: float = 0.01,
                 cost: CostModel | None = None):
        super().__init__(heads, paths, acc)
        self.early, self.layer, self.k = early, layer, k
        if dynamic:
            self.plan(Planner(cost or CostModel(alpha, lam), budgets, replan))
        self.pruning = torch.zeros(2, dtype=torch.long, device=heads.res[0].weight.device)  # draft rows, pruned ones

    @classmethod
    def load(cls, model, weights, layer=None, k=None, prune=True, planner="measured", tree_size=0,
             replan=32) -> "ProPD":
        """k=None: the smallest k whose held-out hit rate keeps KEEP of the right tokens; none: no pruning. planner:
        measured (none of its own: decode.py's core planner on measured costs, AR steps allowed), online (the paper's
        section 4.2: budgets 1-63 from step times learnt as it runs) or static (Medusa's tree every step)."""
        if planner not in PLANNERS:
            raise NanospecError(f"propd planner {planner!r}: choose from {', '.join(PLANNERS)}")
        heads, meta = load_heads(model, weights)
        early = load_early(model, weights, layer) if prune else None
        off = None
        if early is not None and k is None:
            k = min((n for n, hit in early.hits.items() if hit >= KEEP), default=None)
            if k is None:
                best = max(early.hits, default=0)
                off = (f"pruning off: the early head after layer {early.layer} keeps "
                       f"{100 * early.hits.get(best, 0):.0f}% of right tokens at top-{best} (needs {100 * KEEP:.0f}%)")
                early = None
        paths = choose_tree(meta["acc"], tree_size) if tree_size else meta["tree"]
        d = cls(heads, paths, meta["acc"], early, early.layer if early else layer, k or 10, planner == "online",
                replan=replan)
        d.off = off
        return d

    @classmethod
    def random(cls, model, seed=0) -> "ProPD":
        """Noisy heads; an even seed prunes on a static tree after a middle layer with an untrained early head (the
        logit lens: most right tokens in its top sixth), an odd one plans its budgets on a fixed cost line, unpruned."""
        a, paths = model.args, choose_tree(RANDOM_ACC, 12)
        heads = noisy(Heads(a.dim, a.vocab_size, 3).init_from(model.lm_head), seed, 0.1).to(model.embed.weight)
        if seed % 2:  # cheap rows: large trees pay
            line = Measured({1: 1e-2 + 1e-5, 2: 1e-2 + 2e-5})
            return cls(heads, paths, RANDOM_ACC, None, dynamic=True, budgets=(1, 4, 12), replan=4, cost=line)
        early = noisy(EarlyHead(a.dim, a.vocab_size, min(a.dim, 16), a.norm_eps).init_from(model), seed, 0.01)
        return cls(heads, paths, RANDOM_ACC, early.to(model.embed.weight), 1 + seed // 2 % max(a.n_layers - 1, 1),
                   max(2, a.vocab_size // 6), dynamic=False)

    @property
    def prunes(self) -> bool:
        return self.early is not None

    def forward(self, f, nodes):
        if self.early is None:
            return super().forward(f, nodes)
        N = nodes.N
        x = f.layers(f.embed(), 0, self.layer)
        alive = ~pruned(nodes, x[:, :N], self.early, self.k)
        h = f.norm(f.layers(x, self.layer, None, active=alive))
        drafts = nodes.real & (nodes.lay.parent >= 0)  # the root is no draft
        self.pruning.add_(torch.stack([drafts.sum(), (drafts & ~alive).sum()]))
        return replace(self.out(f, h, N), alive=alive)

    def report(self) -> str:
        parts = [self.off] if self.off else []
        if self.early is not None:
            rows, gone = self.pruning.tolist()
            parts.append(f"pruned {gone}/{rows} draft rows ({100 * gone / max(rows, 1):.1f}%) after layer "
                         f"{self.layer}, top-{self.k}")
        return "; ".join(parts + [super().report()])


# --- weights on disk ---------------------------------------------------------------------------
TRAIN_CMD = "python train.py --method propd"


def load_early(model, weights, layer: int | None = None) -> EarlyHead:
    """The early head after `layer` (None: the file's first, e.g. 2 for weights/pylm, 8 for weights/smollm2)."""
    tensors, meta = load_drafter_file(Path(weights) / "propd.safetensors", model, TRAIN_CMD)
    layer = meta["layers"][0] if layer is None else layer
    if layer not in meta["layers"]:
        raise NanospecError(f"propd.safetensors has early heads for layers {meta['layers']}, not {layer}; "
                            f"train it with `{TRAIN_CMD} --early-layers {layer}`")
    a = model.args
    head = EarlyHead(a.dim, a.vocab_size, meta["rank"], a.norm_eps).to(model.embed.weight)
    head.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"layer{layer}.")})
    head.layer, head.hits = layer, {int(k): v for k, v in meta.get("topk_hits", {}).get(str(layer), {}).items()}
    return head.eval()


PLANNERS = ("measured", "online", "static")


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    p.add_argument("--early-layers", default="2,4,6", help="layers to train early heads after (comma-separated)")
    p.add_argument("--early-steps", type=int, default=400)
    p.add_argument("--early-rank", type=int, default=64, help="rank of the early heads' vocabulary projection")
    p.add_argument("--early-batch", type=int, default=1024, help="positions per step")
    p.add_argument("--early-lr", type=float, default=2e-3)


def samples(model, items, layer: int, ahead: int = 1):
    """(layer-n state at t, the model's own token t+ahead) at each position t of (tokens, labels) items where that token
    is known (training/forced.py: labels[t] is the next; further ones where the text went on as the model would)."""
    xs, ys = [], []
    for (tokens, labels), x in zip(items, hidden_states(model, [t for t, _ in items], layer)):
        y = torch.tensor(labels) if ahead == 1 else targets(tokens, labels, ahead - 1)[:, -1]
        keep = y >= 0
        xs.append(x[keep.to(x.device)])
        ys.append(y[keep].to(x.device))
    return torch.cat(xs), torch.cat(ys)


@torch.no_grad()
def topk_hits(head, x, y, ks, batch: int = 4096) -> dict[int, float]:
    """How often the true next token is in the head's top-k, per k."""
    acc = RankAccuracy(1, max(ks))
    for i in range(0, len(x), batch):
        acc.add(head(x[i:i + batch])[:, None], y[i:i + batch, None])
    ranks = acc.result()[0]
    return {k: sum(ranks[:k]) for k in ks}


def train_early(model, items, layer: int, steps: int, rank: int = 64, batch: int = 1024, lr: float = 2e-3,
                seed: int = 0, ahead: int = 1, args=None) -> EarlyHead:
    """Fit an early head after `layer` to the model's own tokens `ahead` positions on (1: the next
    token, ProPD's; more: Hidden Transfer's early-exit baseline); the model stays frozen."""
    x, y = samples(model, items, layer, ahead)
    print(f"early head after layer {layer} for token t+{ahead}: {steps} steps over {len(x):,} positions", flush=True)
    torch.manual_seed(seed)
    a = model.args
    head = EarlyHead(a.dim, a.vocab_size, rank, a.norm_eps).init_from(model).to(x)
    opt = adamw(head, lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + layer)
    ckpt = Checkpoint(args, f"propd-{layer}-{ahead}-{fingerprint(model)}", head, opt, [gen])
    prog = ckpt.progress(steps, every=50)
    for step in ckpt.steps():
        lr_now = cosine_lr(step, ckpt.total, lr, warmup=min(20, steps // 10 + 1))
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        loss = F.cross_entropy(head(x[idx]), y[idx])
        update(opt, loss, lr_now, clip=None)
        prog.step(step, loss.item(), lr_now, len(idx))
    return head


def train(args):
    out = Path(args.out)
    model, train_data, held = distilled(args)
    train_items, held = training_items(model, args, train_data), [labelled(d) for d in held]
    layers = sorted({int(v) for v in args.early_layers.split(",")})
    if not all(1 <= n < model.args.n_layers for n in layers):
        raise NanospecError(f"--early-layers must lie in 1..{model.args.n_layers - 1}")
    heads, hits = nn.ModuleDict(), {}
    for n in layers:
        heads[f"layer{n}"] = train_early(model, train_items, n, args.early_steps, args.early_rank, args.early_batch,
                                          args.early_lr, args.seed, args=args)
        hits[n] = topk_hits(heads[f"layer{n}"], *samples(model, held, n), ks=(1, 5, 10, 20, 50, 100))
        print(f"early head after layer {n}: held-out next token in top-k: "
              + ", ".join(f"top-{k} {v:.3f}" for k, v in hits[n].items()), flush=True)
    meta = {"base_fingerprint": fingerprint(model), "layers": layers, "rank": args.early_rank, "topk_hits": hits}
    save_drafter(out / "propd.safetensors", heads, meta)
    print(f"wrote {out / 'propd.safetensors'}: early heads after layers {layers}")
