"""The Drafter contract: what a method writes, one hook per step of its paper (engine.py runs them).

- draft(dec, cands, template, budget) proposes a tree rooted at the last emitted token: cands are
  the ranked candidates per depth that the last accepted node drafted in the previous step, the
  template the tree shape over them (the method's own or the planner's), budget the draft nodes
  a planner allows. Ranked drafters share one draft (Ranked).
- size(n), rows(dec, tree) lay the step out as rows: the tree's, then the method's own (mask
  tokens, pseudo states, adaptive tokens); size(n) says how many an n-node tree needs.
- forward(f, nodes) is the verification forward on a Forward f (forward.py); it returns an Out:
  the nodes' logits, and per node the drafts that node would make if it ended the accepted path.
- propose(drafts, mm) turns the last accepted node's drafts into logits per depth (K, V), its
  vocabulary products through mm(layer, x) (fast mode's tuned kernels: kernels.py).
- accepted(dec, tree, path) is told what was accepted (Lookahead's trie, SDSAT's statistics).
Plain AR is the base Drafter: a tree of the root alone.
"""
from dataclasses import dataclass

import torch

from .forward import Forward, Out
from .model import Block
from .tree import Tree


@dataclass
class Nodes:
    """A step's tree as the forward sees it, on the device (padded to Q nodes in exact mode)."""
    tokens: torch.Tensor  # (N,) -1 for padding
    lay: object           # tree.Layout
    real: torch.Tensor    # (N,) bool
    n: int                # real nodes
    parents: tuple        # the real tree's parents, on the host


class Drafter:
    """Plain autoregressive decoding; every method subclasses this (see the module docstring)."""
    name = "ar"
    max_rows = 1        # the most rows one step's forward runs (sizes the exact-mode block)
    reserved_slots = 0  # cache slots for method-owned keys
    topk: list[int] = []  # candidates kept per draft depth
    family = None       # the rank paths a planned tree may use (None: any; see planner.Planner)
    planner = None      # the draft budget per step (planner.py); None: the method's static tree
    nested = False      # unranked drafts only: the first s+1 nodes of a budget-B tree are its budget-s tree

    def plan(self, planner) -> "Drafter":
        """Size each step's tree with planner: ranked drafters may then use any of their top-R ranks."""
        self.planner = planner
        if self.topk and self.family is None:
            acc = getattr(self, "acc", None)  # held-out accuracy per depth and rank
            R = len(acc[0]) if acc else 10
            self.topk = [max(R, *self.topk)] * len(self.topk)
        self.max_rows = max(self.max_rows, self.size(1 + max(planner.sizes)))
        return self

    def start(self, dec) -> None:
        """Called once after prefill, before the first step."""

    def draft(self, dec, cands, template, budget) -> Tree:
        """The step's tree: cands (D, R) the last accepted node's ranked candidates per depth (None:
        none), template the tree shape over them (the method's or the planner's), budget the draft
        nodes a planner allows (None: no planner)."""
        return Tree.chain(dec.last)

    def size(self, n: int) -> int:
        """Rows a step over a tree of n nodes runs."""
        return n

    def rows(self, dec, tree: Tree) -> Block:
        return dec.block(tree)

    def shape_key(self, nodes: Nodes):
        """What the forward's computation depends on besides its inputs' shapes (nodes.n, the tree size
        when the method's rows depend on it): exact mode captures a CUDA graph per key."""
        return None

    def forward(self, f: Forward, nodes) -> Out:
        return Out(f.logits(f.norm(f.layers(f.embed())), len(nodes.real)))

    def context(self, dec) -> int:
        """For a drafter without ranked candidates, what its planner conditions a budget's gain on
        (planner.Planner): one context unless the method knows better."""
        return 0

    def propose(self, drafts: torch.Tensor, mm) -> torch.Tensor:
        """Logits per draft depth (K, V) from the last accepted node's drafts (K', D); a bias-free
        layer's product runs as mm(layer, x) (Decoding.mm)."""
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
    accepted node drafted; with none yet, the root alone (whose step drafts)."""

    def draft(self, dec, cands, template, budget):
        return Tree.chain(dec.last) if cands is None else template.tree(dec.last, cands)


AR = Drafter()  # the one AR drafter: every AR step (budget 0, no room to draft) reuses its step program
