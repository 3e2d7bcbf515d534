"""What a step costs, for the planner (planner.py): ProPD's own model of a step's seconds by
(batch, rows) (section 4.2), learnt online from whole steps. A device layer may hand the planner
another (tuning/measured.py: a CPU's forwards measured once by rows, plus what each live batch size's
steps took).
"""
import math


class CostModel:
    """ProPD's iteration-time model: per (batch, rows) an EMA of measured step time, and a line
    T(rows) = b0 + b1 * rows fitted by least squares weighted by exp(-lam * age), age being the
    steps since that row count was last measured. A (batch, rows) measured is priced at its own
    EMA, what its steps took (pruning included: rows are counted before it); the line prices the
    rest, at that batch size only."""

    def __init__(self, alpha: float = 0.3, lam: float = 0.01):
        self.alpha, self.lam, self.step = alpha, lam, 0
        self.perf, self.seen = {}, {}  # (batch, rows) -> EMA of step seconds; step of its last update

    def update(self, rows: int, seconds: float, batch: int = 1, ar: bool = False, budget: int | None = None) -> None:
        """Learn a step's seconds (ar, budget and estimate's bare: the planner's interface, which
        tuning/measured.Measured prices by; this model keys by (batch, rows) alone)."""
        if rows <= batch:  # one row per sequence takes another kernel path on a CPU: it would bend the line
            return
        old = self.perf.get((batch, rows))
        self.perf[batch, rows] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self.seen[batch, rows], self.step = self.step, self.step + 1

    def fit(self, batch: int = 1) -> tuple[float, float] | None:
        """(b0, b1), or None with fewer than two row counts measured."""
        pts = [(r, t, math.exp(-self.lam * (self.step - self.seen[b, r])))
               for (b, r), t in self.perf.items() if b == batch]
        if len({r for r, _, _ in pts}) < 2:
            return None
        W = sum(w for *_, w in pts)
        xm, ym = sum(w * r for r, _, w in pts) / W, sum(w * t for _, t, w in pts) / W
        b1 = sum(w * (r - xm) * (t - ym) for r, t, w in pts) / sum(w * (r - xm) ** 2 for r, _, w in pts)
        return ym - b1 * xm, b1

    def estimate(self, rows: int, batch: int = 1, bare: bool = False, budget: int | None = None) -> float | None:
        """The (batch, rows) EMA, else the line at rows (bare or not: both are of whole steps), None before
        the line has two points."""
        fit = self.fit(batch)
        return None if fit is None else self.perf.get((batch, rows), fit[0] + fit[1] * rows)

    def basis(self, rows: int, batch: int = 1, budget: int | None = None) -> str:
        return "its steps' realized price" if (batch, rows) in self.perf else "the fitted line"
