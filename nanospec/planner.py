"""The draft-size planner: how many nodes a step's tree should have.

ProPD's dynamic tree generation (../shared/papers/propd.txt, section 4.2), in the core so any
method with ranked candidates can use it: a cost model of a step's time as a function of the
tree's size, per-depth acceptance rates of the candidates, the expected accepted length of a
tree (1 for the token verification always yields, plus each node's path probability: Figure 6),
and plan(): the size that maximises expected length per second.
"""
import math

from .tree import choose_tree


class CostModel:
    """ProPD's iteration-time model (section 4.2): per (batch size, tree size) an EMA of measured
    step time, and a line T(size) = b0 + b1 * size fitted by least squares weighted by
    exp(-lambda * age), age being the steps since that size was last measured."""

    def __init__(self, alpha: float = 0.3, lam: float = 0.01):
        self.alpha, self.lam = alpha, lam
        self.perf: dict[tuple[int, int], float] = {}  # (batch, size) -> EMA of iteration time
        self.seen: dict[tuple[int, int], int] = {}    # (batch, size) -> step of the last update
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


class FixedCost(CostModel):
    """A cost model that does not learn: T(size) = b0 + b1 * size, so plans do not depend on
    wall-clock timings (tests; reproducible runs)."""

    def __init__(self, b0: float, b1: float):
        super().__init__()
        self.line = (b0, b1)

    def update(self, size: int, seconds: float, batch: int = 1) -> None:
        pass

    def fit(self, batch: int = 1) -> tuple[float, float]:
        return self.line


class Acceptance:
    """P[i][k]: EMA of "head i's true token was in its top-(k+1)"."""

    def __init__(self, heads: int, topk: int, alpha: float = 0.05, prior: list[list[float]] | None = None):
        self.alpha = alpha
        self.P = [list(row) for row in prior] if prior else [[0.0] * topk for _ in range(heads)]

    def update(self, head: int, rank: int | None) -> None:
        """rank: where the true token was in the head's ranking (None: beyond top-k)."""
        row = self.P[head]
        for k in range(len(row)):
            row[k] = (1 - self.alpha) * row[k] + self.alpha * (rank is not None and rank <= k)

    def p(self) -> list[list[float]]:
        return [[row[k] - (row[k - 1] if k else 0.0) for k in range(len(row))] for row in self.P]


def expected_length(paths: list[tuple[int, ...]], p: list[list[float]]) -> float:
    total = 1.0
    for path in paths:
        total += math.prod(p[d][r] for d, r in enumerate(path))
    return total


def plan(p: list[list[float]], cost: CostModel, sizes, batch: int = 1) -> int | None:
    """The tree size maximising expected accepted length per estimated second (None: no fit yet)."""
    fit = cost.fit(batch)
    if fit is None:
        return None
    speed = {s: expected_length(choose_tree(p, s), p) / max(fit[0] + fit[1] * s, 1e-9) for s in sizes}
    return max(sizes, key=speed.get)
