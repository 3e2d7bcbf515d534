"""The core planner (planner.py) with what a CPU's fast mode adds to it, each kept by a measured A/B
(RESULTS.md, "Why the heuristics stay"):

- Budgets one under fast mode's row buckets (products.BUCKETS): s + 1 rows a sequence, times a batch of
  1, 2, 4 or 8, fill one, where a padded measured.Measured prices a count at its bucket's.
- Replans once a run of one kind of step (batch size, AR or drafting) reaches SETTLE steps: its price and
  what it gets are then known, so a plan that a probe's lucky outcomes sent drafting is undone in SETTLE
  steps, not a replan period.
- Probes: while AR is planned, drafting steps of the cheapest tree renew the acceptance estimates (AR
  steps teach none): PROBE candidate lists per depth from the batch together (PROBE / B steps), their
  expected loss at most SHARE of the time at AR since the last drafting step, waiting at most LONGEST
  replans; their outcomes weigh as PROBE steps of history. The bound: a probe waits for AR steps (the
  clock's tokens since the last drafting step) numbering its expected loss (`loss`, in AR steps at its
  budget) over SHARE, and the waits do not overlap, so over a run the probes' loss is at most SHARE of the
  time at AR, plus the first probe at each budget (priced before its steps are), while one probe's loss
  stays under SHARE * LONGEST * replan AR steps (past that, one probe every LONGEST replans).
- Unranked (nested) drafters, Lookahead's: drafted whole on every step, AR's too, and scored at every
  budget, with the gains kept per match length (Drafter.match_length: the trie's); alone, a budget
  is priced at the nodes its drafts ran (a batch pads every sequence to its longest tree: s + 1).
"""
from collections import Counter

from ..planner import Planner, best

BUDGETS = (0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63)  # one under each of fast mode's row buckets
PROBE = 8      # candidate lists per depth a probe gathers (its batch's together): enough to estimate from
SHARE = 0.02   # a probe's expected loss against AR, as a share of the time at AR before it
SETTLE = 3     # steps of a run of one kind (batch size, AR or drafting) before its price is taken as known: replan
LONGEST = 32   # replans: the longest wait for a probe, so a cost inflated by a stall cannot lock AR in


def own_budgets(drafter) -> None:
    """A method's own planner (ProPD's, the paper's online one) drafts at this machine's budgets too (never 0)."""
    if drafter.planner is not None:
        drafter.planner.budgets = [s for s in BUDGETS if s]
        drafter.plan(drafter.planner)  # its block fits the budgets


class Probing(Planner):
    """The core planner, with probes, SETTLE replans and unranked drafters (see the module docstring)."""

    def __init__(self, cost, budgets=BUDGETS, replan: int = 32, alpha: float = 0.05):
        super().__init__(cost, budgets, replan, alpha)
        self.known, self.run = 0, (None, 0)  # the clock at the last drafting step; this run's (batch, drafting), steps
        # unranked, per (match length, budget): accepted, nodes run
        self.gain, self.tries, self.nodes = {}, Counter(), {}

    def start(self, drafter, dec) -> None:
        super().start(drafter, dec)
        self.drafts, self.match = {}, {}  # per sequence: unranked drafts to score; its match length
        self.probe, self.probing, self.probed, self.fresh = None, 0, False, Counter()

    def lengths(self, sure: bool = False) -> dict[int, float]:
        """Unranked: by the gains each sequence's match length got (untried: as good as its budget)."""
        if self.P:
            return super().lengths(sure)
        cs = list(self.match.values())
        return {s: 1 + sum(s if sure else self.gain.get((c, s), s) for c in cs) / len(cs) for s in self.budgets}

    def seconds(self, s: int, bare: bool = False) -> float:
        """Unranked: alone, a nested draft shorter than s runs whole; a batch's rows are padded to its longest
        tree. Its price is its rows' (with its kind's excess), not the budget's: that depends on the match length."""
        if self.P:
            return super().seconds(s, bare)
        n = self.nodes.get((*self.match.values(), s), s + 1) if self.batch == 1 else s + 1
        return self.cost.estimate(self.batch * (self.drafter.rows(n, s) if s else 1), self.batch, bare)

    def budget(self, decs: list):
        self.match = {id(d): self.drafter.match_length(d) for d in decs}
        return super().budget(decs)

    def choose(self) -> int:
        self.probed = bool(self.probing)
        if self.probing:
            self.probing -= 1
            self.at = self.at if self.probing else None  # then replan on the probe's outcomes
            return self.probe
        if self.P is None:  # unranked: planned every step (its drafts are scored every step)
            self.at = None
        planning = self.due()
        budget = super().choose()
        if not (planning and self.at == self.clock) or budget:
            return budget
        if len(self.budgets) > 1 and best(self.lengths(sure=bool(self.P)), lambda s: self.seconds(s, bare=True)):
            # AR for want of acceptance (a ranked drafter's: an unranked one's drafts are scored every step)
            # or for drafting's cost: a probe renews both. The cheapest tree teaches the first depth (all of
            # them, for heads that draft every depth; rows that follow the budget draft one: drafter.Ranked)
            probe, span = min(s for s in self.budgets if s), -(-PROBE // self.batch)  # PROBE outcomes, the batch's
            if self.clock - self.known >= min(max(self.replan, self.loss(probe, span) / SHARE), LONGEST * self.replan):
                self.probing, self.probe, self.fresh = span, probe, Counter()
                return self.choose()
        return budget

    def loss(self, budget: int, steps: int) -> float:
        """The expected loss of `steps` drafting steps at budget against AR, in AR steps: their price over AR's,
        less the tokens a sequence is expected to get."""
        return steps * (self.seconds(budget) / self.seconds(0) - self.lengths()[budget])

    def observe(self, dec, budget: int, rows: int, seconds: float, path=(0,), drafted=None, cands=None) -> None:
        super().observe(dec, budget, rows, seconds, path, drafted, cands)
        if rows:
            kind = self.batch, bool(budget)
            self.run = kind, self.run[1] + 1 if self.run[0] == kind else 1
            if self.run[1] == SETTLE:  # what this kind of step costs and gets is now known: replan
                self.at = None
            if budget:
                self.known = self.clock
        if self.P is not None:
            return
        seq = id(dec)  # unranked: drafted whole every step, AR's too; its first s nodes are budget s's
        if drafted is not None:  # draft, scored at every s (per match length) once the output is known
            self.drafts.setdefault(seq, []).append((len(dec.out) - len(path), drafted, self.match.get(seq, 0)))
        scored = [(d, d[1].follow(dec.out[d[0]:])) for d in self.drafts.get(seq, [])]
        self.drafts[seq] = [d for d, got in scored if got is None]
        for (_, tree, c), got in ((d, got) for d, got in scored if got):
            for s in filter(None, self.budgets):
                self.learn((c, s), sum(0 < i <= s for i in got), min(len(tree), s + 1))

    def tag(self) -> bool:
        return self.probed

    def weight(self, depth: int, probed) -> float:
        """A probe's outcomes weigh as PROBE steps of history."""
        if not probed:
            return self.alpha
        self.fresh[depth] += 1
        return max(1 / (self.fresh[depth] + PROBE), self.alpha)

    def learn(self, key: tuple[int, int], accepted: int, nodes: int) -> None:
        self.tries[key] += 1
        w = max(1 / self.tries[key], 4 * self.alpha)  # the mean of the first steps, then an EMA
        self.gain[key] = (1 - w) * self.gain.get(key, 0.0) + w * accepted
        self.nodes[key] = (1 - w) * self.nodes.get(key, nodes) + w * nodes
