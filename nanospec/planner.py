"""The draft budget: how many nodes each step's tree has, on this machine.

ProPD's section 4.2 (../shared/papers/propd.txt), in the core so every method gets it: a cost
model of a step's seconds by (batch, rows) (costs.Measured, or ProPD's own online costs.CostModel),
acceptance per depth and rank, the expected accepted length of a tree (1, plus each node's path
probability: Figure 6), and the size with the most expected tokens per second, replanned every
`replan` tokens of the planner's clock (not a cursor, which a refill restarts); the cost model learns
then, from the steps since. Size 0, an AR step, is the one generalisation: drafting that does not pay stops.

Beyond the paper, each with its A/B (RESULTS.md, issue 34's and 35's sections; fp32 fast mode, 2 cores):
- Whole steps: a step costs its forward plus what steps of its kind took beyond it (costs.Measured).
  SmolLM2, B = 1/2/4/8, against the forward alone: BiTA 0.96/0.97/0.97/1.04x (was 0.85/0.96/0.99/0.99x),
  SDSAT 0.96/0.99/0.96/0.96x (was 0.72/0.85/0.89/0.82x); default model, BiTA 0.92x at B = 4 (was 0.72x).
  An unseen batch size takes the nearest one's excess per sequence (SmolLM2, B = 4: SDSAT's sizes 25 -> 3).
- Sizes one under fast mode's row buckets (model.BUCKETS), as costs.Measured prices a forward:
  s + 1 rows (x B = 1, 2, 4, 8) fill one. Default model, B = 1/4: Medusa 1.95/1.48x and 1.90/1.47x
  against 1.76/1.23x and 1.81/1.17x, Hidden Transfer 1.74/1.78x against 1.54/1.54x (B = 1).
- Probes: while AR is planned, drafting steps of the cheapest tree renew the estimates (AR steps teach
  no acceptance): PROBE candidate lists per depth from the batch together (PROBE / B steps), their expected
  loss at most SHARE of the time at AR since the last drafting step. Without them BiTA and Hidden Transfer
  lock into AR on the default model (0.96-0.98x against 1.11-1.13x and 1.55-1.56x); priced so, not at a
  fixed wait, BiTA 1.20/1.10x against 1.15/1.04x, SDSAT 1.15/1.17x against 1.05/0.99x; PROBE / B steps, not
  PROBE, SmolLM2 B = 8: BiTA, HT, SDSAT 0.98/0.99/0.96x against 0.95/0.97/0.94x (default model B = 4: alike).
  Outcomes weigh as PROBE steps of history: SmolLM2, Hidden Transfer 0.96/0.97x against 0.95/0.95x (all of it).
- Nested drafts (Lookahead's) are drafted whole on every step, AR's too, and scored at every budget
  (2.19-2.28x against 1.81-1.97x at the run budget only), with gains per context (the match length:
  default model 2.31-2.40x against 2.00-2.42x pooled, SmolLM2 1.47/1.49x against 1.31/1.34x). Alone, a
  budget is priced at the nodes its drafts run (1.84-2.08x against 1.71-1.86x); a batch pads every
  sequence to its longest tree, so at B > 1 a budget of s keeps s + 1 rows.
"""
import itertools
import math
from collections import Counter

from .tree import Template, choose_tree

SIZES = (0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63)  # one under fast mode's row buckets
PROBE = 8      # candidate lists per depth a probe gathers (its batch's together): enough to estimate from
SHARE = 0.02   # a probe's expected loss against AR, as a share of the time at AR before it
SETTLE = 3     # steps of a kind (batch size, AR or drafting) before its cost is taken as known: then replan
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
    k+1"; an unranked (nested) one, every step, the size whose drafts got the most per second in its
    sequences' contexts (Drafter.context; untried: as good as its size)."""

    def __init__(self, cost, sizes=SIZES, replan: int = 32, alpha: float = 0.05):
        self.cost, self.sizes, self.replan, self.alpha = cost, sorted(sizes), replan, alpha
        self.used, self.clock, self.known = Counter(), 0, 0  # steps per size; tokens decoded; the clock at the last drafting step
        self.steps, self.kinds = [], Counter()  # steps not yet learnt by the cost model; steps per (batch, drafting)
        self.batch = 1  # the sequences of the step planned (the cost model's key: a batch's rows share a forward)
        self.P, self.gain, self.tries = None, {}, Counter()  # unranked: (context, size) -> drafts accepted,
        self.nodes = {}  # and the nodes its drafts ran (a draft shorter than the budget runs whole)

    def start(self, drafter, dec) -> None:
        self.drafter = drafter
        if self.P is None and drafter.topk:  # the prior: the trainer's held-out accuracies, if any
            K, R = len(drafter.topk), max(drafter.topk)
            acc = getattr(drafter, "acc", None) or [[0.6 * 0.7 ** d if r == 0 else 0.02 for r in range(R)] for d in range(K)]
            self.P = [[sum(row[:r + 1]) for r in range(R)] for row in acc]
        self.pending, self.drafts, self.context = {}, {}, {}  # per sequence: candidates and drafts to score, context
        self.at, self.size, self.tree, self.probe = None, None, None, None
        self.probing, self.probed, self.fresh = 0, False, Counter()

    def p(self, sure: bool = False) -> list[list[float]]:
        """Per depth, the probability that rank k is right (sure: as if every top-1 were)."""
        return [[float(k == 0) if sure else row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))] for row in self.P]

    def lengths(self, sure: bool = False) -> dict[int, float]:
        """The expected accepted length per size, of a sequence of the batch on average (unranked: by
        the gains each sequence's context got; untried: as good as its size)."""
        if self.P:
            return tree_lengths(self.p(sure), self.sizes, self.drafter.family)
        cs = list(self.context.values())
        return {s: 1 + sum(s if sure else self.gain.get((c, s), s) for c in cs) / len(cs) for s in self.sizes}

    def seconds(self, s: int, bare: bool = False) -> float:
        """A step's cost with a budget of s draft nodes for each sequence of the batch (bare: its forward's).
        Alone, a nested draft shorter than s runs whole; a batch's rows are padded to its longest tree."""
        n = self.nodes.get((*self.context.values(), s), s + 1) if self.batch == 1 else s + 1
        return self.cost.estimate(self.batch * (self.drafter.size(n) if s else 1), self.batch, bare)

    def budget(self, decs: list) -> tuple[int, Template | None]:
        """This step's draft nodes for every sequence of a batch (0: an AR step) and, for a ranked
        drafter, the tree of that size; replanned when the batch changes, as section 4.2 does."""
        if len(decs) != self.batch:
            self.batch, self.at = len(decs), None
        self.context = {id(d): self.drafter.context(d) for d in decs}
        size = self.choose()
        self.used[size] += 1
        if size and self.P and (self.tree is None or self.tree[0] != size):  # built once per plan
            self.tree = size, Template.of(tuple(choose_tree(self.p(), size, self.drafter.family)))
        return size, self.tree[1] if size and self.P else None

    def choose(self) -> int:
        self.probed = bool(self.probing)
        if self.probing:
            self.probing -= 1
            self.at = self.at if self.probing else None  # then replan on the probe's outcomes
            return self.probe
        B = self.batch
        if self.at is None or self.clock - self.at >= self.replan or self.P is None:
            while self.steps:  # the cost model learns at each plan, from the steps since the last
                self.cost.update(*self.steps.pop(0))
            if self.cost.estimate(B, B) is None:  # an online cost model has no line yet: two sizes first
                first = len(self.drafter.template) - 1 if getattr(self.drafter, "template", None) else self.sizes[-1]
                return next((s for s in (first, 1) if (B, B * self.drafter.size(s + 1)) not in self.cost.perf), 1)
            lengths = self.lengths()
            self.at, self.size = self.clock, best(lengths, self.seconds)
            if not self.size and best(self.lengths(sure=bool(self.P)), lambda s: self.seconds(s, bare=True)):
                # AR for want of acceptance (a ranked drafter's: an unranked one's drafts are scored every
                # step) or for drafting's cost: a probe renews both, its expected loss (in AR steps) at most
                # SHARE of the tokens at AR since the last drafting step. The cheapest tree teaches all
                probe, span = min(s for s in self.sizes if s), -(-PROBE // B)  # its steps: PROBE outcomes, the batch's
                extra = span * (self.seconds(probe) / self.seconds(0) - lengths[probe])
                if self.clock - self.known >= min(max(self.replan, extra / SHARE), LONGEST * self.replan):
                    self.probing, self.probe, self.fresh = span, probe, Counter()
                    return self.choose()
        return self.size

    def observe(self, dec, size: int, rows: int, seconds: float, path=(0,), drafted=None, cands=None) -> None:
        """After a step, per sequence: the step's rows and time (rows 0: a batch's step is counted with
        its first sequence), the sequence's accepted path (node indices, root first), a nested drafter's whole
        draft (the step ran its first size + 1 nodes), and the next candidates (host lists per depth)."""
        if rows:  # a batch's step is timed with its first sequence: the probes' cadence is one sequence's tokens
            self.steps.append((rows, seconds, self.batch, not size))
            self.kinds[self.batch, bool(size)] += 1
            if self.kinds[self.batch, bool(size)] == SETTLE:  # what this kind of step costs is now known: replan
                self.at = None
            self.clock += len(path)
            if size:
                self.known = self.clock
        seq = id(dec)  # its Decoding, not its cache row: continuous batching gives a row to the next prompt
        if self.P is None:  # unranked: drafted whole every step, AR's too; its first s nodes are budget s's
            if drafted is not None:  # draft, scored at every s (per context) once the output is known
                self.drafts.setdefault(seq, []).append((len(dec.out) - len(path), drafted, self.context.get(seq, 0)))
            scored = [(d, d[1].follow(dec.out[d[0]:])) for d in self.drafts.get(seq, [])]
            self.drafts[seq] = [d for d, got in scored if got is None]
            for (_, tree, c), got in ((d, got) for d, got in scored if got):
                for s in filter(None, self.sizes):
                    self.learn((c, s), sum(0 < i <= s for i in got), min(len(tree), s + 1))
            return
        n, out = len(dec.out), dec.out
        for i, depth, guess, probed in self.pending.get(seq, []):  # a candidate list of depth d guessed output i
            if i < n:
                self.fresh[depth] += probed  # a probe's outcomes: weighed beside PROBE steps of history
                w = max(1 / (self.fresh[depth] + PROBE), self.alpha) if probed else self.alpha
                rank = guess.index(out[i]) if out[i] in guess else len(guess)
                self.P[depth] = [(1 - w) * q + w * (rank <= k) for k, q in enumerate(self.P[depth])]
        self.pending[seq] = [q for q in self.pending.get(seq, []) if q[0] >= n] + \
            [(n + d, d, c, self.probed) for d, c in enumerate(cands or [])]

    def learn(self, key: tuple[int, int], accepted: int, nodes: int) -> None:
        self.tries[key] += 1
        w = max(1 / self.tries[key], 4 * self.alpha)  # the mean of the first steps, then an EMA
        self.gain[key] = (1 - w) * self.gain.get(key, 0.0) + w * accepted
        self.nodes[key] = (1 - w) * self.nodes.get(key, nodes) + w * nodes

    def report(self) -> str:
        return "budget " + ", ".join(f"{s} ({100 * c / self.used.total():.0f}%)" for s, c in self.used.most_common(4))
