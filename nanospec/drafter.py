"""The Drafter contract: what a method writes, one hook per step of its paper (engine.py runs them).

- draft(dec, cands, template, budget) proposes a tree rooted at the last emitted token: cands are
  the ranked candidates per depth that the last accepted node drafted in the previous step, the
  template the tree shape over them (the method's own or the planner's), budget the draft nodes
  a planner allows. Ranked drafters share one draft (Ranked).
- groups(tree, n, budget) says which rows the method adds after the tree (mask tokens, pseudo
  states, adaptive tokens), as a tree.Groups the engine lays out; rows(n, budget) says how many
  rows an n-node tree's step runs. The engine lays the rows out: no hook calls back into it.
- forward(f, nodes) is the verification forward on a forward.Forward f (nodes: tree.Nodes, with
  the groups' M); it returns an Out: the nodes' logits, and per node the drafts that node would
  make if it ended the accepted path.
- propose(draft_inputs, linear) turns each sequence's last accepted node's drafts into logits per depth
  (B, K, V), as one product for the batch (Medusa's heads). A method whose drafts are the lm_head's
  own rows (BiTA's masks, Hidden Transfer's pseudo states, SDSAT's adaptive tokens) returns their
  logits from the forward's one head product instead: a second product would read the head's
  weights again, and at a few rows that read is the product's cost.
- accepted(dec, tree, path) is told what was accepted (Lookahead's trie, SDSAT's statistics).
- start(dec), once after prefill, may fill the method's reserved slots (BiTA's prompt tokens' keys, through
  Decoding.run or KVCache.write_reserved): the one hook that runs the model, before any step.
Plain AR is the base Drafter: a tree of the root alone. A hook returns what a later one needs; none
sets state that another reads later in the step, and none writes the Decoding or the cache outside the
method's reserved slots: the engine owns them.

What a method knows it declares, so the command line, the planner and the tests need no list of methods:
load (decode.py's loader: its options are a spec's), random (trained parts for a tiny random model: the
tests'), warm_up (text to draft from before any prompt: how a context drafter is fed), floor (the tokens
per step it reaches when fed AR's continuation: the tests' check of its draft quality), max_draft (the
largest draft it ever makes: no planner offers more), drafts_from (--show's words), model_dir.
"""
from dataclasses import dataclass

import torch

from .forward import Forward
from .tree import Groups, Nodes, Tree


class Borrowed(list):
    """The model's modules a drafter uses (Medusa's shared lm_head, the model its token heads read): a list, so not
    the drafter's own parameters (never trained or saved), and shared, not copied, when the drafter is deep-copied
    for another run (a copy of the model would copy what a device's programs are bound to)."""
    def __deepcopy__(self, memo):
        return self


def plain(proj, x):
    """A product as its module runs it, proj(x): propose's `linear` where the device gives no form of its own."""
    return proj(x)


@dataclass
class Out:
    """What a method's verification forward computed, per sequence of the batch and tree node (tree
    rows come first)."""
    logits: torch.Tensor                 # (B, N, V): each node's logits, verified against AR
    draft_inputs: torch.Tensor | None = None  # (B, N, K', D): per node, what drafts the next tree if it ends the
    #                                           accepted path (hidden states or logits); propose makes (K, V) of them
    depths: torch.Tensor | None = None   # (B, N): how many of the K draft depths are real (None: all; 0: none)
    alive: torch.Tensor | None = None    # (B, N) bool: the nodes left to verify (ProPD prunes the rest)


class Drafter:
    """Plain autoregressive decoding; every method subclasses this (see the module docstring)."""
    name = "ar"
    max_rows = 1        # the most rows one step's forward runs (sizes the exact-mode block)
    reserved_slots = 0  # cache slots for method-owned keys
    topk: list[int] = []  # candidates kept per draft depth
    allowed_paths = None  # the rank paths a planned tree may use (None: any; see planner.Planner)
    planner = None      # the draft budget per step (planner.py); None: the method's static tree
    nested = False      # unranked drafts only: the first s+1 nodes of a budget-B tree are its budget-s tree
    own_rows = "own rows"  # what the rows after the tree are, for a reader (show.py)
    prunes = False      # verification leaves some nodes out (ProPD): a greedy step reads back which
    template = None     # a ranked drafter's tree shape over its candidates (tree.Template; None: none)
    acc = None          # held-out accuracy per draft depth and rank, from its trainer (the planner's prior; None: none)
    max_draft: int | None = None  # the most draft nodes a step proposes (None: any a planner offers)
    drafts_from = "from the context after"  # where drafts came from, before the context's matched tokens (show.py)
    floor: float | None = 1.0  # tokens per step, at least, when a test feeds it AR's continuation (None: undeclared)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.floor = cls.__dict__.get("floor")  # each method declares its own: a subclass's is not its parent's

    @classmethod
    def load(cls, model, weights) -> "Drafter":
        """decode.py's loader (methods.load_drafter): the drafter for model, its trained parts read from the
        directory weights; the options of a spec (name:key=value,...) are keyword arguments after these two."""
        return AR if cls is Drafter else cls()

    @classmethod
    def random(cls, model, seed: int = 0) -> "Drafter":
        """The drafter with random trained parts for a tiny random model, seeded (the tests'): a method with
        trained parts overrides it; a training-free one is what its loader makes, reading no file (AR: a Drafter
        of its own, so a test may change it)."""
        return cls() if cls is Drafter else cls.load(model, None)

    @staticmethod
    def model_dir(weights):
        """The model directory it decodes (and AR with it): the given weights, unless a method fine-tunes its own."""
        return weights

    def warm_up(self, texts: list[list[int]]) -> None:
        """Token sequences to draft from before any prompt (Lookahead's trie, PLD's earlier context): how a
        context drafter is fed text, a test's AR continuations among them. A method drafting from trained
        parts reads none."""

    @property
    def is_ar(self) -> bool:
        """Plain AR, the base Drafter itself: a tree of the root alone, whose key a step writes in place."""
        return type(self) is Drafter

    @property
    def max_depth(self) -> int:
        """The most draft tokens on one path of its trees (exact mode gathers 1 + this many keys per row in
        canonical order: sizes.shapes): a chain of max_rows nodes, unless the drafter knows better."""
        return self.max_rows - 1

    def plan(self, planner) -> "Drafter":
        """Size each step's tree with planner, whose budgets go no higher than max_draft: ranked drafters may then
        use any of their top-R ranks."""
        if self.max_draft is not None:
            planner.budgets = sorted({min(s, self.max_draft) for s in planner.budgets})
        self.planner = planner
        if self.topk and self.allowed_paths is None:
            R = len(self.acc[0]) if self.acc else 10
            self.topk = [max(R, *self.topk)] * len(self.topk)
        self.max_rows = max(self.max_rows, self.rows(1 + max(planner.budgets), max(planner.budgets)))
        return self

    def start(self, dec) -> None:
        """Called once after prefill, before the first step."""

    def draft(self, dec, cands, template, budget) -> Tree:
        """The step's tree: cands (D, R) the last accepted node's ranked candidates per depth (None:
        none), template the tree shape over them (the method's or the planner's), budget the draft
        nodes a planner allows (None: no planner, or a nested drafter: it drafts whole, and the engine
        runs the first budget + 1 nodes)."""
        return Tree.chain(dec.root)

    def match_length(self, dec) -> int:
        """What predicts how much of an unranked drafter's next draft is accepted (Lookahead: how long a
        suffix its trie matches): tuning/probing.Probing, the planner that plans unranked drafters, keeps its gains
        per match length."""
        return 0

    def rows(self, n: int, budget: int | None = None) -> int:
        """Rows a step over a tree of n nodes runs at `budget` (None: no planner; a method's own rows
        may follow the budget: SDSAT's adaptive tokens)."""
        return n

    def groups(self, tree: Tree, n: int, budget: int | None = None) -> Groups:
        """The rows the method adds after the tree, from row n (n >= len(tree): the largest tree of
        the batch's step), as groups after host nodes; the forward reads their M (nodes.M)."""
        return Groups()

    def forward(self, f: Forward, nodes: Nodes) -> Out:
        return Out(f.logits(f.norm(f.layers(f.embed())), nodes.N))

    def propose(self, draft_inputs: torch.Tensor, linear=plain) -> torch.Tensor:
        """Logits per draft depth (B, K, V) from each sequence's last accepted node's draft inputs (B, K', D);
        linear(proj, x): the device's form of a product (devices.Device.forms, else plain: a draft's need not be
        AR's)."""
        return draft_inputs

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
    sets `ahead`, the depths they reach. Under a planner a step runs only the first min(ahead,
    budget) of them (own_depths): the next tree is at most budget deep, so deeper rows would draft what no
    tree verifies, and on a CPU every row costs a step a little."""
    ahead = 0  # depths the method's own rows draft (0: none, Medusa's heads draft from the tree's rows)

    @property
    def max_depth(self) -> int:
        """A tree over ranked candidates is at most one node per depth deep; a planner's trees reach
        every depth its prior covers (planner.Planner.start: the trainer's accuracies, else topk's)."""
        return max(len(self.topk), len(self.acc or [])) if self.planner else len(self.topk)

    def own_depths(self, budget: int | None = None) -> int:
        """Depths drafted by a step's own rows at budget (None: no planner, all of them)."""
        return self.ahead if budget is None else min(self.ahead, budget)

    def draft(self, dec, cands, template, budget):
        return Tree.chain(dec.root) if cands is None else template.tree(dec.root, cands)


def noisy(module: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """module with Gaussian noise of std `scale` added to every parameter, seeded: random trained parts (random)
    that draft something, sometimes right."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * scale)
    return module


RANDOM_ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]  # a random drafter's accuracy per depth and rank
AR = Drafter()  # the one AR drafter: every AR step (budget 0, no room to draft) reuses its step program

