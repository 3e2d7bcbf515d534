"""The Drafter contract: what a method writes, one hook per step of its paper (engine.py runs them).

- draft(dec, cands, template, budget) proposes a tree rooted at the last emitted token: cands are
  the ranked candidates per depth that the last accepted node drafted in the previous step, the
  template the tree shape over them (the method's own or the planner's), budget the draft nodes
  a planner allows. Ranked drafters share one draft (Ranked).
- size(n), rows(dec, tree) lay the step out as rows: the tree's, then the method's own (mask
  tokens, pseudo states, adaptive tokens); size(n) says how many an n-node tree needs.
- forward(f, nodes) is the verification forward on a Forward f; it returns an Out: the nodes'
  logits, and per node the drafts that node would make if it ended the accepted path. Forward and
  Out live here: they are what a method's forward is written with.
- propose(drafts, linear) turns each sequence's last accepted node's drafts into logits per depth
  (B, K, V), as one product for the batch (Medusa's heads). A method whose drafts are the lm_head's
  own rows (BiTA's masks, Hidden Transfer's pseudo states, SDSAT's adaptive tokens) returns their
  logits from the forward's one head product instead: a second product would read the head's
  weights again, and at a few rows that read is the product's cost.
- accepted(dec, tree, path) is told what was accepted (Lookahead's trie, SDSAT's statistics).
Plain AR is the base Drafter: a tree of the root alone.
"""
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .cache import Block
from .model import Context
from .tree import Layout, Tree, layout


class Forward:
    """One forward pass over a block of rows, as a method's step is written against it: embed, run
    layers (all rows, or only the `active` ones: ProPD's survivors of pruning, Hidden Transfer's
    real rows before its pseudo rows join), norm, logits. The core decides how: fast mode runs only
    active rows (removed, then put back); exact mode runs every row of its fixed-shape block, since
    a row's result never depends on the other rows, and so the whole step can be one CUDA graph.
    Training forwards use the same object over a cache-free, masked context (`training`), so a
    method's trainer and its decoder share one layer loop."""

    def __init__(self, model, block: Block, ctx: Context, kv):
        """kv(i): layer i's key/value buffers (the KV cache's, or a training forward's own). The
        block holds B sequences' rows (a batch; one in training's masked forwards' sense too)."""
        self.model, self.block, self.ctx, self.kv = model, block, ctx, kv
        self.exact = ctx.exact

    @classmethod
    def on_cache(cls, model, block: Block, cache, exact: bool, seqs=None, tail: int = 1, dev=None) -> "Forward":
        """seqs (B,): the cache rows of the block's sequences (None: the cache's rows in order); tail: exact
        mode's keys gathered per row (sizes.shapes' W); dev: the device's layout and speed (devices.py)."""
        ctx = model.context(block, cache.k.shape[-2], exact, seqs, tail, dev, cache.ids)
        return cls(model, block, ctx, cache.layer)

    @classmethod
    def training(cls, model, tokens, pos, vis, prefix=None) -> "Forward":
        """A cache-free forward over rows that see each other as vis (B, R, K + R) says, K being
        the keys and values that prefix[i] or prefix(i) puts before the rows in layer i (SDSAT's
        frozen standard rows, BiTA's deep prompt)."""
        (B, R), a = tokens.shape, model.args
        K = vis.shape[-1] - R
        ctx = Context(*model.rope(pos), torch.arange(K, K + R, device=tokens.device), False, mask=vis, L=K + R)
        blk = Block(tokens, pos, ctx.slots, torch.zeros_like(pos), torch.full((B, R, 1), -1, device=tokens.device))
        w = model.embed.weight

        def kv(i):
            kv = w.new_zeros(2, B, a.kv_heads, R, a.hd)
            if prefix is None:
                return kv
            pkv = prefix(i) if callable(prefix) else prefix[i]  # (2, 1 or B, Hkv, K, D)
            return torch.cat([pkv.expand(-1, B, -1, -1, -1), kv], 3)
        return cls(model, blk, ctx, kv)

    def embed(self) -> torch.Tensor:
        return self.model.embed(self.block.tokens)

    def layers(self, x, start: int = 0, stop: int | None = None, active=None, delta=None) -> torch.Tensor:
        """x after layers start..stop-1. active (R,) or per sequence (B, R) bool: the rows that need
        them; fast mode runs only those (in a batch, the rows some sequence needs; the others keep x),
        exact mode runs all rows (inactive ones are never read). delta: per layer, an update of its
        products on some rows (model.Context.delta: SDSAT's adaptive rows), for a whole block (no active)."""
        layers = range(start, len(self.model.layers) if stop is None else stop)
        ctx, rows = self.ctx, None
        active = active.any(0) if active is not None and active.dim() == 2 else active
        if active is not None and not self.exact and not bool(active.all()):
            rows = active.nonzero()[:, 0]
            ctx, y = ctx.select(rows), x[:, rows]
        else:
            y = x
        for i in layers:
            c = ctx if delta is None else replace(ctx, delta=delta[i])
            y = c.layer(self.model.layers[i], y, self.kv(i))
        return y if rows is None else x.index_copy(1, rows, y)

    def norm(self, x) -> torch.Tensor:
        return self.model.norm(x)

    def logits(self, h, n: int) -> torch.Tensor:
        """The first n rows' logits (B, n, V). Exact mode multiplies every row, as AR's block does (a
        GEMM's rows depend on its shape); fast mode only the n asked for."""
        if self.exact:
            return self.ctx.mm(self.model.lm_head, self.ctx.rows(h))[:, :n]
        return self.ctx.mm(self.model.lm_head, h[:, :n])


@dataclass
class Out:
    """What a method's verification forward computed, per sequence of the batch and tree node (tree
    rows come first)."""
    logits: torch.Tensor                 # (B, N, V): each node's logits, verified against AR
    drafts: torch.Tensor | None = None   # (B, N, K', D): per node, what drafts the next tree if it ends the
    #                                      accepted path (hidden states or logits); propose makes (K, V) of them
    depths: torch.Tensor | None = None   # (B, N): how many of the K draft depths are real (None: all; 0: none)
    alive: torch.Tensor | None = None    # (B, N) bool: the nodes left to verify (ProPD prunes the rest)


@dataclass
class Nodes:
    """A step's trees as the forward sees them, on the device: one per sequence of the batch, padded
    to N nodes (Q in exact mode). Rows a method adds after the tree start at row n for every
    sequence (a smaller tree's rows up to n are filler: Decoding.block)."""
    tokens: torch.Tensor  # (B, N) -1 for padding (one sequence's alone: (N,))
    lay: object           # tree.Layout, each field with the batch dim first
    real: torch.Tensor    # (B, N) bool
    n: int                # the largest tree's nodes

    @property
    def N(self) -> int:
        return self.tokens.shape[-1]

    @staticmethod
    def stack(nodes: list["Nodes"], n: int) -> "Nodes":
        """Sequences' nodes as one batch, each padded to the most nodes (token -1, not real); n: the largest tree's."""
        N = max(x.N for x in nodes)
        pad = lambda t, v: torch.stack([F.pad(x, (0, N - len(x)), value=v) for x in t])
        return Nodes(pad([x.tokens for x in nodes], -1), Layout.stack([x.lay for x in nodes], N),
                     pad([x.real for x in nodes], False), n)


class Drafter:
    """Plain autoregressive decoding; every method subclasses this (see the module docstring)."""
    name = "ar"
    max_rows = 1        # the most rows one step's forward runs (sizes the exact-mode block)
    reserved_slots = 0  # cache slots for method-owned keys
    topk: list[int] = []  # candidates kept per draft depth
    family = None       # the rank paths a planned tree may use (None: any; see planner.Planner)
    planner = None      # the draft budget per step (planner.py); None: the method's static tree
    nested = False      # unranked drafts only: the first s+1 nodes of a budget-B tree are its budget-s tree

    @property
    def max_depth(self) -> int:
        """The most draft tokens on one path of its trees (exact mode gathers 1 + this many keys per row in
        canonical order: sizes.shapes): a chain of max_rows nodes, unless the drafter knows better."""
        return self.max_rows - 1

    def plan(self, planner) -> "Drafter":
        """Size each step's tree with planner: ranked drafters may then use any of their top-R ranks."""
        self.planner = planner
        if self.topk and self.family is None:
            acc = getattr(self, "acc", None)  # held-out accuracy per depth and rank
            R = len(acc[0]) if acc else 10
            self.topk = [max(R, *self.topk)] * len(self.topk)
        self.max_rows = max(self.max_rows, self.size(1 + max(planner.sizes), max(planner.sizes)))
        return self

    def start(self, dec) -> None:
        """Called once after prefill, before the first step."""

    def draft(self, dec, cands, template, budget) -> Tree:
        """The step's tree: cands (D, R) the last accepted node's ranked candidates per depth (None:
        none), template the tree shape over them (the method's or the planner's), budget the draft
        nodes a planner allows (None: no planner, or a nested drafter: it drafts whole, and the engine
        runs the first budget + 1 nodes)."""
        return Tree.chain(dec.last)

    def context(self, dec) -> int:
        """What predicts how much of an unranked drafter's next draft is accepted (Lookahead: how long a
        suffix its trie matches): the planner keeps its gains per context."""
        return 0

    def size(self, n: int, budget: int | None = None) -> int:
        """Rows a step over a tree of n nodes runs: this step's, or a planner's price of a step at
        `budget` (a method's own rows may follow the budget: SDSAT's adaptive tokens)."""
        return n

    def rows(self, dec, tree: Tree, n: int) -> Block:
        """The step's rows: the tree's, then any the method adds, from row n (n >= len(tree): the
        largest tree of the batch's step)."""
        return dec.block(tree)

    def shape_key(self, nodes: Nodes):
        """What the forward's computation depends on besides its inputs' shapes (nodes.n, when the
        method adds rows after the tree): exact mode captures a CUDA graph per key."""
        return None

    def forward(self, f: Forward, nodes) -> Out:
        return Out(f.logits(f.norm(f.layers(f.embed())), nodes.N))

    def propose(self, drafts: torch.Tensor, linear=None) -> torch.Tensor:
        """Logits per draft depth (B, K, V) from each sequence's last accepted node's drafts (B, K', D); linear(layer,
        x): the device's form of a product (devices.Device.kernels: a draft's need not be AR's kernel)."""
        return drafts

    def accepted(self, dec, tree: Tree, path: list[int]) -> None:
        """Called after commit with the accepted path (node indices, root first)."""

    def finish(self, dec) -> None:
        """Called once when the generation stops."""

    def report(self) -> str:
        """A line of method statistics for the benchmark (e.g. ProPD's pruning rate, the budgets)."""
        return self.planner.report() if self.planner is not None else ""


class Ranked(Drafter):
    """A drafter of ranked candidates per depth (Medusa's heads, BiTA's masks, Hidden Transfer's
    pseudo states, SDSAT's adaptive tokens): its tree is the template over the candidates the last
    accepted node drafted; with none yet, the root alone (whose step drafts).

    A method whose own rows draft depth by depth (a mask, a pseudo row, an adaptive token per depth)
    sets `ahead`, the depths they reach. Under a planner a step runs only the first `now` of them,
    min(ahead, budget): the next tree is at most budget deep, so deeper rows would draft what no tree
    verifies, and on a CPU every row costs a step a little."""
    ahead = 0  # depths the method's own rows draft (0: none, Medusa's heads draft from the tree's rows)
    now = 0    # of them, this step's

    @property
    def max_depth(self) -> int:
        """A tree over ranked candidates is at most one node per depth deep; a planner's trees reach
        every depth its prior covers (planner.Planner.start: the trainer's accuracies, else topk's)."""
        return max(len(self.topk), len(getattr(self, "acc", None) or [])) if self.planner else len(self.topk)

    def own(self, budget: int | None = None) -> int:
        """Depths drafted by this step's own rows (budget: a planned step's, for its price)."""
        return self.now if budget is None else min(self.ahead, budget)

    def draft(self, dec, cands, template, budget):
        self.now = self.ahead if budget is None else self.own(budget)
        return Tree.chain(dec.last) if cands is None else template.tree(dec.last, cands)


AR = Drafter()  # the one AR drafter: every AR step (budget 0, no room to draft) reuses its step program


@functools.lru_cache(maxsize=16)
def idle(Q: int, trash: int, n_slots: int, device) -> tuple[Block, Nodes]:
    """An idle sequence's block and nodes in exact mode's block batch, made once: Q padding rows (they
    write and read the trash slot of their cache row) and a tree of no real node; read-only."""
    z = torch.zeros(1, Q, dtype=torch.long, device=device)
    slots = torch.full((Q,), trash, device=device)
    extra = F.pad(slots.view(1, Q, 1), (0, n_slots - 1), value=-1)
    nodes = Nodes(torch.full((Q,), -1, device=device), layout((-1,), device).pad(Q), ~ones(Q, device), 1)
    return Block(z, z, slots, z, extra), nodes


@functools.lru_cache(maxsize=256)
def ones(n: int, device) -> torch.Tensor:
    """n True flags on the device, made once (every real node of a fast-mode step); read-only."""
    return torch.ones(n, dtype=torch.bool, device=device)
