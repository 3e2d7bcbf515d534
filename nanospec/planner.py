"""The draft budget: how many nodes each step's tree should have, on this machine.

ProPD's dynamic tree generation (../shared/papers/propd.txt, section 4.2), in the core so every
method gets it: a cost model of a step's time as a function of its rows, per-depth acceptance
rates of the drafter's ranked candidates, the expected accepted length of a tree (1 for the
token verification always yields, plus each node's path probability: Figure 6), and the size
that maximises expected length per second. Size 0 is an AR step: when drafting does not pay,
the budget shrinks to it. Costs come from one of:
- Measured: ms per forward by rows, measured once per machine, model, dtype and mode and
  cached (costs.measure): what a row costs here, not what a GPU intuition expects;
- CostModel: ProPD's own, learnt online from step times (section 4.2);
- FixedCost: a line, for tests.

Beyond the paper (RESULTS.md has the runs behind each):
- Probes. AR steps teach the acceptance estimates nothing, so a replan that picks AR for want of
  acceptance first takes PROBE drafting steps and replans on their outcomes, which replace the
  stale estimates; probes grow rarer while they confirm AR, up to one in WAIT replans.
- Unranked drafters (Lookahead's trie) are planned by their measured tokens per step at each
  budget, per context the drafter names (Drafter.context: how long a suffix the trie matched);
  an untried budget looks as good as its size, and a nested draft (a smaller budget's is a prefix
  of a larger one's) teaches every smaller budget at each step.
- Step ratios. A forward's cost by rows is not a step's (Medusa's heads, pseudo rows, host work):
  per size, the median of the last RATIOS observed-over-estimated step times scales the estimate
  (robust to a shared machine's stalls); a drafting step's ratio is kept relative to AR's at the
  time, since the machine's speed drifts and hits both alike. Only Measured costs need it.
"""
import bisect
import functools
import itertools
import math
import statistics
from collections import Counter

from .tree import Template, choose_tree

SIZES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
RATIOS = 9  # steps per size the observed-over-estimated ratio is the median of
MARGIN = 0.05  # drafting must promise 5% more tokens/s than an AR step: estimates err, AR never loses
EXPLORE = 8    # a nested drafter's drafting steps per context per probe (see Planner.budget)
PROBE = 8      # drafting steps per probe while AR is planned: enough outcomes to estimate from
WAIT = 8       # at most this many replans at AR between probes


class CostModel:
    """ProPD's iteration-time model (section 4.2): per (batch size, rows) an EMA of measured step
    time, and a line T(rows) = b0 + b1 * rows fitted by least squares weighted by
    exp(-lambda * age), age being the steps since that size was last measured."""
    forwards_only = False  # learnt from whole steps (or, FixedCost, declared): taken as it is

    def __init__(self, alpha: float = 0.3, lam: float = 0.01):
        self.alpha, self.lam = alpha, lam
        self.perf: dict[tuple[int, int], float] = {}  # (batch, rows) -> EMA of iteration time
        self.seen: dict[tuple[int, int], int] = {}    # (batch, rows) -> step of the last update
        self.step = 0

    def update(self, size: int, seconds: float, batch: int = 1) -> None:
        key = (batch, size)
        old = self.perf.get(key)
        self.perf[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self.seen[key] = self.step
        self.step += 1

    def fit(self, batch: int = 1) -> tuple[float, float] | None:
        """(b0, b1) of the weighted least-squares line, or None with fewer than two sizes measured."""
        pts = [(s, t, math.exp(-self.lam * (self.step - self.seen[(b, s)])))
               for (b, s), t in self.perf.items() if b == batch]
        if len({s for s, _, _ in pts}) < 2:
            return None
        W = sum(w for _, _, w in pts)
        xm = sum(w * s for s, _, w in pts) / W
        ym = sum(w * t for _, t, w in pts) / W
        b1 = sum(w * (s - xm) * (t - ym) for s, t, w in pts) / sum(w * (s - xm) ** 2 for s, _, w in pts)
        return ym - b1 * xm, b1

    def estimate(self, size: int, batch: int = 1) -> float | None:
        fit = self.fit(batch)
        return None if fit is None else fit[0] + fit[1] * size

    def measured(self) -> set[int]:
        return {s for _, s in self.perf}


class FixedCost(CostModel):
    """A cost model that does not learn: T(rows) = b0 + b1 * rows, so plans do not depend on
    wall-clock timings (tests; reproducible runs)."""

    def __init__(self, b0: float, b1: float):
        super().__init__()
        self.line = (b0, b1)

    def update(self, size: int, seconds: float, batch: int = 1) -> None:
        pass

    def fit(self, batch: int = 1) -> tuple[float, float]:
        return self.line


class Measured(FixedCost):
    """Seconds per forward by rows, as measured (costs.measure): linear between the points,
    and along the last segment's slope beyond them. A count measured slower than a larger one
    takes the larger one's time: fast mode's kernels run a product on more rows when that is
    faster (kernels.py), and otherwise the gap is the machine's noise."""
    forwards_only = True  # a step also pays the method's own work: the planner learns how much

    def __init__(self, points: dict[int, float]):
        super().__init__(0.0, 0.0)
        rows, secs = zip(*sorted((int(r), s) for r, s in points.items()))
        self.rows, self.secs = rows, tuple(itertools.accumulate(secs[::-1], min))[::-1]

    def estimate(self, size: int, batch: int = 1) -> float:
        i = min(max(bisect.bisect_left(self.rows, size), 1), len(self.rows) - 1)
        (r0, r1), (s0, s1) = self.rows[i - 1:i + 1], self.secs[i - 1:i + 1]
        return max(s0 + (s1 - s0) * (size - r0) / (r1 - r0), 1e-9)


class Acceptance:
    """P[i][k]: EMA of "depth i's true token was in its top-(k+1)"."""

    def __init__(self, heads: int, topk: int, alpha: float = 0.05, prior: list[list[float]] | None = None):
        self.alpha = alpha
        self.P = [list(row) for row in prior] if prior else [[0.0] * topk for _ in range(heads)]

    def update(self, head: int, rank: int | None, w: float | None = None) -> None:
        """rank: where the true token was in the depth's ranking (None: beyond top-k); w: the new
        outcome's weight (default alpha)."""
        row, w = self.P[head], self.alpha if w is None else w
        for k in range(len(row)):
            row[k] = (1 - w) * row[k] + w * (rank is not None and rank <= k)

    def p(self) -> list[list[float]]:
        return [[row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))] for row in self.P]


def expected_lengths(paths: list[tuple[int, ...]], p: list[list[float]]) -> list[float]:
    """[i]: the expected accepted length of a tree of the first i paths: 1 for the token verification
    always yields, plus each node's path probability (Figure 6)."""
    return list(itertools.accumulate((math.prod(p[d][r] for d, r in enumerate(q)) for q in paths), initial=1.0))


def plan(p: list[list[float]], cost: CostModel, sizes, rows=lambda n: n, allowed=None, scale=lambda s: 1.0) -> int | None:
    """The tree size (draft nodes) maximising expected accepted length per estimated second (None:
    no estimate yet). rows(n): the rows a step over n tree nodes runs; size 0 is an AR step;
    scale(s): the observed step time over the estimate at size s."""
    if cost.estimate(1) is None:
        return None
    # choose_tree's best s paths are the first s of its best max(sizes): one search serves every size
    paths = choose_tree(p, max(sizes), allowed)
    length = expected_lengths(paths, p)
    speed = {s: length[min(s, len(paths))] / max(cost.estimate(rows(s + 1) if s else 1) * scale(s), 1e-9)
             * (1 + MARGIN * (s == 0)) for s in sizes}
    return max(sizes, key=speed.get)


class Planner:
    """Each step's budget for one drafter (see the module docstring). Ranked drafters (those with
    `topk`) get the best tree of each size from their allowed paths (Drafter.family: None for any
    ranks), replanned when the sequence has moved `replan` tokens; others get a draft-token budget,
    replanned every step (a budget whose gain fell would otherwise run on for `replan` tokens)."""

    def __init__(self, cost: CostModel, sizes=SIZES, replan: int = 32, alpha: float = 0.05):
        self.cost, self.sizes, self.replan, self.alpha = cost, sorted(sizes), replan, alpha
        self.used = Counter()  # planned size -> steps
        self.ratios = {}       # planned size -> the last RATIOS (a step's seconds over the cost estimate, AR's then)
        self.steps = Counter() # planned size -> steps observed
        self.rows_seen = frozenset()  # the row counts of the steps observed
        self.accept = self.gain = None
        self.tries = Counter()  # (context, size) -> steps observed, for a draft-token budget's gain
        self.probing, self.probe = 0, None  # drafting steps left to take while AR is planned, and their size
        self.probed = False     # this step is a probe's
        self.fresh = Counter()  # depth -> outcomes resolved since the last probe began
        self.ar_plans, self.wait = 0, 1     # replans in a row that chose AR; how many before the next probe
        self.ctx = 0
        self.idle, self.waits = Counter(), Counter()  # per context: replans in a row at AR; the next probe's
        self.explored = Counter()  # per context: drafting steps of a nested drafter

    def start(self, drafter, dec) -> None:
        if self.accept is None and drafter.topk:  # prior: the trainer's held-out accuracies, if any
            K, R = len(drafter.topk), max(drafter.topk)
            acc = getattr(drafter, "acc", None) or [[0.6 * 0.7 ** d if r == 0 else 0.02 for r in range(R)] for d in range(K)]
            self.accept = Acceptance(K, R, self.alpha, [[sum(row[:r + 1]) for r in range(R)] for row in acc])
        if self.gain is None and not drafter.topk:
            self.gain = {}  # (context, size) -> accepted drafts per step
        self.nested = getattr(drafter, "nested", False)
        self.pending, self.at, self.size, self.tree, self.probing = [], None, None, None, 0

    def budget(self, drafter, dec) -> tuple[int, Template | None]:
        """This step's draft nodes (0: an AR step) and, for a ranked drafter, the best tree of that size."""
        size = self.choose(drafter, dec)
        return size, self.tree if size else None

    def choose(self, drafter, dec) -> int:
        self.probed = bool(self.probing)
        if 0 in self.sizes and self.steps[0] < 3 and any(self.ratios):  # drafting's real cost is known:
            self.used[0] += 1                                             # measure an AR step's too
            return 0
        if self.probing:  # AR steps teach the acceptance estimates nothing: a few drafting steps do
            self.probing -= 1
            if not self.probing:
                self.at = None  # replan on the probe's outcomes
            self.used[self.probe] += 1
            return self.probe
        if self.at is None or abs(dec.cur - self.at) >= self.replan or self.size is None or self.accept is None:
            rows = lambda n: drafter.size(n)
            if self.accept is not None:
                self.size = plan(self.accept.p(), self.cost, self.sizes, rows, drafter.family, self.scale)
                self.ar_plans = self.ar_plans + 1 if self.size == 0 else 0
                self.wait = self.wait if self.size == 0 else 1
                sure = lambda: [[1.0] + [0.0] * (len(row) - 1) for row in self.accept.P]  # every top-1 right
                if self.ar_plans >= self.wait and self.at is not None and plan(sure(), self.cost, self.sizes, rows, drafter.family, self.scale):
                    # AR until the next replan for want of acceptance, not of cheap rows: probe first,
                    # more rarely while the probes keep confirming AR (after 1, 2, 4, then every 8 replans)
                    self.ar_plans, self.wait, self.fresh = 0, min(2 * self.wait, WAIT), Counter()
                    self.probe = plan(self.accept.p(), self.cost, [s for s in self.sizes if s], rows, drafter.family, self.scale)
                    self.probing, self.tree = PROBE, template(tuple(choose_tree(self.accept.p(), self.probe, drafter.family)))
                    self.at = dec.cur
                    return self.choose(drafter, dec)
            elif self.cost.estimate(1) is not None:
                self.ctx = c = drafter.context(dec)
                secs = lambda s: self.cost.estimate(rows(s + 1) if s else 1) * self.scale(s)
                self.size = max(self.sizes, key=lambda s: (1 + self.gain.get((c, s), s)) * (1 + MARGIN * (s == 0)) / secs(s))
                self.idle[c] = self.idle[c] + 1 if self.size == 0 else 0
                self.waits[c] = self.waits[c] if self.size == 0 else 1
                drafting = [s for s in self.sizes if s]  # a probe: the largest budget within twice an AR step's time
                probe = lambda: max((s for s in drafting if secs(s) <= 2 * secs(0)), default=drafting[0])
                if self.idle[c] >= self.waits[c] and drafting:  # AR for want of gains: probe (replans 1, 2, 4...)
                    self.waits[c] *= 2
                    self.size = probe()
                elif self.size and self.nested:  # a nested step teaches only the budgets up to its own:
                    self.explored[c] += 1        # every EXPLORE-th drafting step of a context probes
                    if self.explored[c] % EXPLORE == 0:
                        self.size = max(self.size, probe())
            if self.size is None:  # an online cost model has no line yet: measure two sizes first
                seen, static = self.cost.measured(), getattr(drafter, "template", None)
                first = len(static) - 1 if static is not None else self.sizes[-1]
                self.size = next((s for s in (first, 1) if drafter.size(s + 1) not in seen), 1)
            else:
                self.at = dec.cur
            self.tree = template(tuple(choose_tree(self.accept.p(), self.size, drafter.family))) \
                if self.accept is not None and self.size else None
        self.used[self.size] += 1
        return self.size

    def observe(self, dec, size: int, rows: int, accepted: int, seconds: float, path=None, drafted=0) -> None:
        """After a step: its time (online costs learn from steps of several rows: one row takes
        another, faster kernel path on a CPU and would bend the line), and how its drafts fared
        (path: the accepted node indices, root first, of a tree of drafted + 1 nodes)."""
        if rows > 1:
            self.cost.update(rows, seconds)
        est = self.cost.estimate(rows)
        self.steps[size] += 1
        first, self.rows_seen = rows not in self.rows_seen, self.rows_seen | {rows}
        if est and self.cost.forwards_only and not first:  # a row count's first step may pay one-time costs
            if size not in self.ratios:
                self.at = None  # the first measure of what this size really costs: replan now
            ar = self.scale(0) if size and 0 in self.ratios else None
            self.ratios[size] = (self.ratios.get(size, []) + [(seconds / est, ar)])[-RATIOS:]
        if self.accept is None:
            if size:  # a nested draft's step also tells what every smaller budget would have got, and,
                      # when the drafter ran out of nodes below its budget, what every larger one would
                got = {s: sum(0 < i <= s for i in path) for s in self.sizes if s and (s <= size or drafted < size)} \
                    if self.nested and path is not None else {size: accepted}
                for s, a in got.items():
                    key = (self.ctx, s)
                    self.tries[key] += 1
                    w = max(1 / self.tries[key], 4 * self.alpha)  # the mean of the first steps, then an EMA
                    self.gain[key] = (1 - w) * self.gain.get(key, 0.0) + w * a
            return
        n, out = len(dec.out), dec.out
        for i, depth, cands, probed in self.pending:  # a candidate of depth d guessed output i
            if i < n:
                self.fresh[depth] += probed  # a probe's outcomes: their mean, then the EMA
                w = max(1 / self.fresh[depth], self.accept.alpha) if probed else None
                self.accept.update(depth, cands.index(out[i]) if out[i] in cands else None, w)
        self.pending = [q for q in self.pending if q[0] >= n]
        self.pending += [(n + d, d, c, self.probed) for d, c in enumerate(dec.cand_lists or [])]

    def scale(self, size: int) -> float:
        """The observed step time over the estimate at size. A drafting step's counts relative to an
        AR step's at the time it was taken: the machine's speed drifts (a shared VM's stalls, a
        longer context) and hits both alike, so stale drafting times must not be set against fresh
        AR ones."""
        ar = statistics.median_low([r for r, _ in self.ratios[0]]) if 0 in self.ratios else 1.0
        rel = lambda obs: statistics.median_low([r / (then or ar) for r, then in obs])
        if not size:
            return ar
        if size in self.ratios:
            return ar * rel(self.ratios[size])
        drafting = [rel(obs) for s, obs in self.ratios.items() if s]
        return ar * (max(drafting) if drafting else 1.0)

    def report(self) -> str:
        total = sum(self.used.values())
        top = sorted(self.used.items(), key=lambda kv: -kv[1])[:4]
        return "budget " + ", ".join(f"{s} ({100 * c / total:.0f}%)" for s, c in top)


@functools.lru_cache(maxsize=256)
def template(paths: tuple) -> Template:
    """One Template per tree shape, built once."""
    return Template(paths)
