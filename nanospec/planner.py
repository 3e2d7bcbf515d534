"""The draft budget: how many nodes each step's tree has, on this machine.

ProPD's section 4.2 (../shared/papers/propd.txt), in the core so every method gets it: a cost
model of a step's seconds by (batch, rows) (costs.Measured, or ProPD's own online costs.CostModel),
acceptance per depth and rank, the expected accepted length of a tree (1, plus each node's path
probability: Figure 6), and the size with the most expected tokens per second, replanned every
`replan` tokens. Size 0, an AR step, is the one generalisation: drafting that does not pay stops.

Beyond the paper, each with its A/B (RESULTS.md, issue 34's and 35's sections; fp32 fast mode, 2 cores):
- Whole steps: a step costs its forward plus what steps of its kind took beyond their forwards
  (costs.Measured: drafting, the draft heads' products, a method's own rows, the host's work),
  learnt from the steps' own times; with the probes below. SmolLM2 at B = 1/2/4/8, against the
  forward alone: BiTA 0.96/0.97/0.97/1.04x (was 0.85/0.96/0.99/0.99x), SDSAT 0.96/0.99/0.96/0.96x
  (was 0.72/0.85/0.89/0.82x); default model: BiTA 0.92x at B = 4 (was 0.72x), 0.98x beside a
  neighbour's job (was 0.80-0.91x), but Medusa 1.69x at B = 1 (was 1.83-1.86x) and Lookahead
  2.38-2.64x (was 2.64-2.77x): larger trees for a cost spread over them, and more AR steps. A
  batch size not seen yet takes the nearest seen one's excess per sequence: SmolLM2, B = 4, the
  drafting steps at the tail's sizes (3, 2, 1) fell from 25 to 3 (SDSAT) and 16 to 11 (BiTA).
- Probes: AR steps teach no acceptance, so while AR is planned, PROBE drafting steps of the
  cheapest tree renew the estimates (acceptance and cost), once AR has run since the last drafting
  step long enough that the probe's expected loss against AR is at most SHARE of that time. Without
  probes BiTA and Hidden Transfer lock into AR on the default model (0.96-0.98x against 1.11-1.13x
  and 1.55-1.56x). Priced at its expected loss, not its whole cost, a probe comes sooner the closer
  drafting is to paying: default model, B = 1, BiTA 1.20/1.10x (against 1.15/1.04x), SDSAT
  1.15/1.17x (against 1.05/0.99x); other methods and sizes within the spread.
- Nested drafts (Lookahead's) are drafted whole, run as their first s nodes, and scored at every
  budget once the output is known: 2.19-2.28x against 1.81-1.97x scored at the run budget only.
  Alone, a budget is priced at the nodes its drafts run (a shorter draft runs whole; a trie that
  matches nothing costs an AR step): default model 1.84-2.08x against 1.71-1.86x, SmolLM2
  1.31/1.37x against 1.30/1.29x, at B = 1. A batch pads every sequence to its longest tree, so at
  B > 1 a budget of s keeps its s + 1 rows (at its drafts' nodes, SmolLM2 at B = 4 read 1.09/1.11x
  against 1.14/1.16x).
"""
import itertools
import math
from collections import Counter

from .tree import Template, choose_tree

SIZES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
PROBE = 8      # drafting steps per probe: enough outcomes to estimate from
SHARE = 0.02   # a probe's expected loss against AR, as a share of the time at AR before it
LONGEST = 32   # replans: the longest wait for a probe, so a cost inflated by a stall cannot lock AR in


def expected_lengths(paths: list[tuple[int, ...]], p: list[list[float]]) -> list[float]:
    """[i]: the expected accepted length of a tree of the first i paths (Figure 6)."""
    return list(itertools.accumulate((math.prod(p[d][r] for d, r in enumerate(q)) for q in paths), initial=1.0))


def tree_lengths(p: list[list[float]], sizes, family=None) -> dict[int, float]:
    """The expected length of the best tree of each size (the best s paths are the first s of the best)."""
    paths = choose_tree(p, max(sizes), family)
    length = expected_lengths(paths, p)
    return {s: length[min(s, len(paths))] for s in sizes}


def best(lengths: dict[int, float], seconds) -> int:
    """The size with the most expected tokens per second."""
    return max(lengths, key=lambda s: lengths[s] / max(seconds(s), 1e-9))


class Planner:
    """Each step's budget for one drafter. A ranked one (with `topk`) gets the best tree of each size
    over its rank paths (Drafter.family) from P[d][k], an EMA of "depth d's true token was in its top
    k+1"; an unranked one a budget by the mean drafts each got (untried: its size), every step."""

    def __init__(self, cost, sizes=SIZES, replan: int = 32, alpha: float = 0.05):
        self.cost, self.sizes, self.replan, self.alpha = cost, sorted(sizes), replan, alpha
        self.used, self.clock, self.known = Counter(), 0, 0  # steps per size; tokens decoded; the clock at the last drafting step
        self.batch = 1  # the sequences of the step planned (the cost model's key: a batch's rows share a forward)
        self.P, self.gain, self.tries = None, {}, Counter()  # unranked: size -> drafts accepted
        self.nodes = {}  # nested: size -> the nodes its drafts ran (a draft shorter than the budget runs whole)

    def start(self, drafter, dec) -> None:
        self.drafter = drafter
        if self.P is None and drafter.topk:  # the prior: the trainer's held-out accuracies, if any
            K, R = len(drafter.topk), max(drafter.topk)
            acc = getattr(drafter, "acc", None) or [[0.6 * 0.7 ** d if r == 0 else 0.02 for r in range(R)] for d in range(K)]
            self.P = [[sum(row[:r + 1]) for r in range(R)] for row in acc]
        self.pending, self.drafts = {}, {}  # per sequence (id of its Decoding): candidate lists and drafts to score
        self.at, self.size, self.tree, self.probe = None, None, None, None
        self.probing, self.probed, self.fresh = 0, False, Counter()

    def p(self, sure: bool = False) -> list[list[float]]:
        """Per depth, the probability that rank k is right (sure: as if every top-1 were)."""
        return [[float(k == 0) if sure else row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))] for row in self.P]

    def lengths(self, sure: bool = False) -> dict[int, float]:  # expected accepted length per size
        return tree_lengths(self.p(sure), self.sizes, self.drafter.family) if self.P else \
            {s: 1 + (s if sure else self.gain.get(s, s)) for s in self.sizes}

    def seconds(self, s: int, bare: bool = False) -> float:
        """A step's cost with a budget of s draft nodes for each sequence of the batch (bare: its forward's).
        Alone, a nested draft shorter than s runs whole; a batch's rows are padded to its longest tree."""
        n = self.nodes.get(s, s + 1) if self.batch == 1 else s + 1
        return self.cost.estimate(self.batch * (self.drafter.size(n) if s else 1), self.batch, bare)

    def budget(self, dec, batch: int = 1) -> tuple[int, Template | None]:
        """This step's draft nodes for every sequence of a batch (0: an AR step) and, for a ranked
        drafter, the tree of that size; replanned when the batch changes, as section 4.2 does."""
        if batch != self.batch:
            self.batch, self.at = batch, None
        size = self.choose(dec)
        self.used[size] += 1
        if size and self.P and (self.tree is None or self.tree[0] != size):  # built once per plan
            self.tree = size, Template.of(tuple(choose_tree(self.p(), size, self.drafter.family)))
        return size, self.tree[1] if size and self.P else None

    def choose(self, dec) -> int:
        self.probed = bool(self.probing)
        if self.probing:
            self.probing -= 1
            self.at = self.at if self.probing else None  # then replan on the probe's outcomes
            return self.probe
        B = self.batch
        if self.cost.estimate(B, B) is None:  # an online cost model has no line yet: two sizes first
            first = len(self.drafter.template) - 1 if getattr(self.drafter, "template", None) else self.sizes[-1]
            return next((s for s in (first, 1) if (B, B * self.drafter.size(s + 1)) not in self.cost.perf), 1)
        if self.at is None or dec.cur - self.at >= self.replan or self.P is None:
            lengths = self.lengths()
            self.at, self.size = dec.cur, best(lengths, self.seconds)
            if not self.size and best(self.lengths(sure=True), lambda s: self.seconds(s, bare=True)):
                # AR for want of acceptance or for drafting's cost: a probe renews both, its expected loss (in
                # AR steps) at most SHARE of the tokens at AR since the last drafting step. The cheapest tree
                # teaches all: a ranked drafter's candidates come at every depth, a nested one drafts whole
                probe = min(s for s in self.sizes if s)
                extra = PROBE * (self.seconds(probe) / self.seconds(0) - lengths[probe])
                if self.clock - self.known >= min(max(self.replan, extra / SHARE), LONGEST * self.replan):
                    self.probing, self.probe, self.fresh = PROBE, probe, Counter()
                    return self.choose(dec)
        return self.size

    def observe(self, dec, size: int, rows: int, seconds: float, path=(0,), drafted=None, cands=None) -> None:
        """After a step, per sequence: the step's rows and time (rows 0: a batch's step is counted with
        its first sequence), the sequence's accepted path (node indices, root first), a nested drafter's whole
        draft (the step ran its first size + 1 nodes), and the next candidates (host lists per depth)."""
        if rows:  # a batch's step is timed with its first sequence: the probes' cadence is one sequence's tokens
            if self.cost.update(rows, seconds, self.batch, ar=not size):  # what this kind of step costs is now known: replan
                self.at = None
            self.clock += len(path)
            if size:
                self.known = self.clock
        seq = id(dec)  # its Decoding, not its cache row: continuous batching gives a row to the next prompt
        if self.P is None and seq not in self.drafts:  # a trie takes in each new prompt's branches: its
            self.known = -math.inf  # gains go stale, so the next AR plan probes
        drafts = self.drafts.get(seq, [])
        if self.P is None and size and self.drafter.nested:  # drafted whole: its first s nodes are budget s's draft,
            drafts.append((len(dec.out) - len(path), drafted))  # scored at every s once the output is known
        elif self.P is None and size:
            self.learn(size, len(path) - 1)
        scored = [(d, d[1].follow(dec.out[d[0]:])) for d in drafts]
        self.drafts[seq] = [d for d, got in scored if got is None]
        for (_, tree), got in ((d, got) for d, got in scored if got):
            for s in filter(None, self.sizes):
                self.learn(s, sum(0 < i <= s for i in got), min(len(tree), s + 1))
        if self.P is None:
            return
        n, out = len(dec.out), dec.out
        for i, depth, guess, probed in self.pending.get(seq, []):  # a candidate list of depth d guessed output i
            if i < n:
                self.fresh[depth] += probed  # a probe's outcomes: their mean, then the EMA
                w = max(1 / self.fresh[depth], self.alpha) if probed else self.alpha
                rank = guess.index(out[i]) if out[i] in guess else len(guess)
                self.P[depth] = [(1 - w) * q + w * (rank <= k) for k, q in enumerate(self.P[depth])]
        self.pending[seq] = [q for q in self.pending.get(seq, []) if q[0] >= n] + \
            [(n + d, d, c, self.probed) for d, c in enumerate(cands or [])]

    def learn(self, s: int, accepted: int, nodes: int | None = None) -> None:
        self.tries[s] += 1
        w = max(1 / self.tries[s], 4 * self.alpha)  # the mean of the first steps, then an EMA
        self.gain[s] = (1 - w) * self.gain.get(s, 0.0) + w * accepted
        if nodes is not None:
            self.nodes[s] = (1 - w) * self.nodes.get(s, nodes) + w * nodes

    def report(self) -> str:
        return "budget " + ", ".join(f"{s} ({100 * c / self.used.total():.0f}%)" for s, c in self.used.most_common(4))
