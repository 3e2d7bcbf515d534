"""The draft budget: how many nodes each step's tree has.

ProPD's section 4.2 (Shuzhang Zhong, Zebin Yang, Meng Li, Ruihao Gong, Runsheng Wang, Ru Huang, "ProPD: Dynamic
Token Tree Pruning and Generation for LLM Parallel Decoding", 2024, arXiv:2402.13485), in the core so every ranked
method gets it: a cost model of a step's seconds by (batch, rows) that the planner is given (ProPD's own online
costs.CostModel, or a device layer's: tuning/measured.Measured), acceptance per depth and rank, the expected accepted
length of a tree (1, plus each node's path probability: Figure 6), and the budget with the most expected tokens per
second, replanned every `replan` tokens of the planner's clock (not a cursor, which a refill restarts) and whenever
the batch size changes. The cost model learns at each plan, from the steps since. Two generalisations:
- Budget 0, an AR step: drafting that does not pay stops.
- The expected lengths are calibrated by what drafting steps got: the draft tokens accepted over those the model
  expected (an EMA over the steps after a drafting step; a step after AR has no drafts to verify, a switch's price).
Figure 6 scores a tree as if every step had drafts: a drafter whose drafts ride on one node (SDSAT's adaptive tokens)
has none after a step that stops short of it, and a plan made on a good run of acceptance meets the run's end. The
estimates per depth stay the paper's; the ratio prices what they leave out, so a drafter the planner trusted goes to
AR where its drafts do not pay.

Prices are the live batch's: a step is priced at the number of sequences live, as the batch's last sequences run
too, and a cost model that learns prices each batch size and budget by what its steps really took (costs.CostModel's
table, tuning/measured.Measured's realized price), so a method whose step is not the planner's tree (pruned rows,
adaptive rows, masks) is priced at what it costs. Acceptance is the sequences': one estimate serves every batch
size. A ledger keeps, per live batch size, what the planner expected of its AR and drafting steps and what they got
(`profile`, decode.py --bench --profile); `priced` names a step's price (decode.py --show).

This planner plans ranked drafters (with `topk`); an unranked (nested) one, Lookahead's or PLD's, is planned by
tuning/probing.Probing alone. A device layer may hand a drafter a planner that adds to this one (tuning/probing.py:
probes, unranked drafters' gains, budgets that fill a CPU's row buckets), and budgets of its own.
"""
import itertools
import math
from collections import Counter

from .tree import Template, choose_tree

BUDGETS = (0, 1, 3, 7, 15, 31, 63)  # the paper names none: with its root, each a power of two rows, doubling
PRIOR = 8  # drafting steps' worth of belief in the model's own lengths before the calibration moves it


def expected_lengths(paths: list[tuple[int, ...]], p: list[list[float]]) -> list[float]:
    """[i]: the expected accepted length of a tree of the first i paths (Figure 6)."""
    return list(itertools.accumulate((math.prod(p[d][r] for d, r in enumerate(q)) for q in paths), initial=1.0))


def tree_lengths(p: list[list[float]], budgets, allowed=None) -> dict[int, float]:
    """The expected length of the best tree of each budget (the best s paths are the first s of the best)."""
    paths = choose_tree(p, max(budgets), allowed)
    length = expected_lengths(paths, p)
    return {s: length[min(s, len(paths))] for s in budgets}


def best(lengths: dict[int, float], seconds) -> int:
    """The budget with the most expected tokens per second."""
    return max(lengths, key=lambda s: lengths[s] / max(seconds(s), 1e-9))


class Planner:
    """Each step's budget for one ranked drafter (with `topk`): the best tree of each budget over its rank
    paths (Drafter.allowed_paths) from P[d][k], an EMA of "depth d's true token was in its top k+1"."""

    def __init__(self, cost, budgets=BUDGETS, replan: int = 32, alpha: float = 0.05):
        self.cost, self.budgets, self.replan, self.alpha = cost, sorted(budgets), replan, alpha
        self.used, self.clock = Counter(), 0  # steps per budget; tokens decoded
        self.steps = []  # steps not yet learnt by the cost model
        self.batch = 1  # the sequences of the step planned (the cost model's key: a batch's rows share a forward)
        self.P, self.last = None, {}  # per depth and rank: acceptance (start); per sequence: its last step's budget
        self.raw, self.got, self.want, self.seen = {}, 0.0, 0.0, 0  # calibration: model lengths; EMAs, steps
        self.expect, self.planned = {}, None  # per budget at the last plan: (tokens a sequence, seconds); this step's
        self.ledger = {}  # (batch, drafting) -> [steps, tokens, seconds, expected tokens, expected seconds]

    def start(self, drafter, dec) -> None:
        self.drafter = drafter
        if self.P is None and drafter.topk:  # the prior: the trainer's held-out accuracies, if any
            K, R = len(drafter.topk), max(drafter.topk)
            acc = drafter.acc or [[0.6 * 0.7 ** d if r == 0 else 0.02 for r in range(R)] for d in range(K)]
            self.P = [[sum(row[:r + 1]) for r in range(R)] for row in acc]
        self.pending = {}  # per sequence: the candidate lists still to score
        self.at, self.chosen, self.tree = None, None, None  # chosen: the last plan's budget

    def p(self, sure: bool = False) -> list[list[float]]:
        """Per depth, the probability that rank k is right (sure: as if every top-1 were)."""
        return [[float(k == 0) if sure else row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))]
                for row in self.P]

    def lengths(self, sure: bool = False) -> dict[int, float]:
        """The expected accepted length per budget, of a sequence of the batch (sure: the model's, as if
        every top-1 were right; else calibrated by the drafting steps' outcomes)."""
        raw = tree_lengths(self.p(sure), self.budgets, self.drafter.allowed_paths)
        if sure:
            return raw
        self.raw = raw
        return {s: 1 + self.calibration() * (n - 1) for s, n in raw.items()}

    def calibration(self) -> float:
        """Draft tokens accepted per draft token the model expected, over the drafting steps (1: none yet)."""
        return self.got / self.want if self.want > 0 else 1.0

    def rows(self, s: int) -> int:
        """A step's rows at a budget of s draft nodes for each sequence of the batch."""
        return self.batch * (self.drafter.rows(s + 1, s) if s else 1)

    def seconds(self, s: int, bare: bool = False) -> float:
        """A step's cost with a budget of s draft nodes for each sequence of the batch (bare: its forward's)."""
        return self.cost.estimate(self.rows(s), self.batch, bare, budget=s)

    def budget(self, decs: list) -> tuple[int, Template | None]:
        """This step's draft nodes for every sequence of a batch (0: an AR step) and, for a ranked
        drafter, the tree of that many nodes; replanned when the batch changes, as section 4.2 does."""
        if len(decs) != self.batch:
            self.batch, self.at = len(decs), None
        budget = self.choose()
        self.used[budget] += 1
        self.planned = self.batch, budget, self.expect.get(budget)
        if budget and self.P and (self.tree is None or self.tree[0] != budget):  # built once per plan
            self.tree = budget, Template.of(tuple(choose_tree(self.p(), budget, self.drafter.allowed_paths)))
        return budget, self.tree[1] if budget and self.P else None

    def due(self) -> bool:
        return self.at is None or self.clock - self.at >= self.replan

    def choose(self) -> int:
        if self.due():
            while self.steps:  # the cost model learns at each plan, from the steps since the last
                self.cost.update(*self.steps.pop(0))  # rows, seconds, batch, ar, budget (None: not the price's key)
            B = self.batch
            if self.cost.estimate(B, B) is None:  # an online cost model has no line yet: two budgets first
                first = len(self.drafter.template) - 1 if self.drafter.template else self.budgets[-1]
                return next((s for s in (first, 1) if (B, B * self.drafter.rows(s + 1, s)) not in self.cost.perf), 1)
            lengths = self.lengths()
            self.expect = {s: (n, self.seconds(s)) for s, n in lengths.items()}
            self.at, self.chosen = self.clock, best(lengths, lambda s: self.expect[s][1])
        return self.chosen

    def observe(self, dec, budget: int, rows: int, seconds: float, path=(0,), drafted=None, cands=None) -> None:
        """After a step, per sequence: the step's rows and time (rows 0: a batch's step is counted with
        its first sequence), the sequence's accepted path (node indices, root first), a nested drafter's
        whole draft (for a subclass: tuning/probing.Probing scores it), and the next candidates (host lists
        per depth)."""
        B, _, expect = self.planned or (self.batch, budget, None)
        row = self.ledger.setdefault((B, bool(budget)), [0, 0, 0.0, 0.0, 0.0])  # the ledger: every sequence's tokens
        row[1] += len(path)
        if rows:  # a batch's step is timed with its first sequence: the clock counts one sequence's tokens
            self.steps.append((rows, seconds, self.batch, not budget, budget if self.P else None))
            self.clock += len(path)
            row[0], row[2] = row[0] + 1, row[2] + seconds
            if expect is not None:  # a planned step (not a first one, before the cost model has a price)
                row[3:] = row[3] + B * expect[0], row[4] + expect[1]
        seq, n, out = id(dec), len(dec.out), dec.out  # its Decoding, not its cache row: a row takes the next prompt
        if budget and self.last.get(seq) and budget in self.raw:  # after a drafting step (an AR step leaves no drafts):
            want = self.raw[budget] - 1  # the model's expectation at the last plan against what the step got
            if not self.seen:  # the prior: PRIOR steps that got what the model expected
                self.got = self.want = want
            self.seen += 1
            w = max(1 / (self.seen + PRIOR), self.alpha)
            self.got += w * (len(path) - 1 - self.got)
            self.want += w * (want - self.want)
        self.last[seq] = budget
        for i, depth, guess, tag in self.pending.get(seq, []):  # a candidate list of depth d guessed output i
            if i < n:
                w = self.weight(depth, tag)
                rank = guess.index(out[i]) if out[i] in guess else len(guess)
                self.P[depth] = [(1 - w) * q + w * (rank <= k) for k, q in enumerate(self.P[depth])]
        self.pending[seq] = [q for q in self.pending.get(seq, []) if q[0] >= n] + \
            [(n + d, d, c, self.tag()) for d, c in enumerate(cands or [])]

    def tag(self):
        """What a candidate list carries to its scoring (a subclass's: whether a probe drafted it)."""
        return None

    def weight(self, depth: int, tag) -> float:
        """How much one outcome moves depth's estimate."""
        return self.alpha

    def priced(self, budget: int) -> str:
        """The price this step's plan used, for a reader (decode.py --show)."""
        if self.planned is None or self.planned[2] is None:
            return "no price yet: its first steps measure one"
        n, secs = self.planned[2]
        basis = self.cost.basis(self.rows(budget), self.batch, budget if self.P else None)
        return f"priced {1000 * secs:.1f} ms a step for {n:.2f} tokens a sequence ({basis})"

    def profile(self, name: str) -> str:
        """Per live batch size, the tokens per second the planner expected of its AR steps and drafts, and got."""
        lines = []
        for (B, drafting), (steps, tokens, secs, want, want_s) in sorted(self.ledger.items()):
            expected = f"expected {want / want_s:.1f}" if want_s else "no expectation (exploring)"
            lines.append(f"[profile] {name}'s planner, B = {B}, {'drafting' if drafting else 'AR'}: {steps} steps, "
                         f"{expected}, realized {tokens / max(secs, 1e-9):.1f} tokens/s")
        return "\n".join(lines)

    def report(self) -> str:
        return "budget " + ", ".join(f"{s} ({100 * c / self.used.total():.0f}%)" for s, c in self.used.most_common(4))
