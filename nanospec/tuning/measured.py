"""What a step costs on this machine, for the planner (planner.py): a forward's seconds by rows,
measured once per machine, model, dtype and mode and cached (what a row costs here, not what a GPU
intuition expects), plus what a whole step costs beyond its forward, and what steps of each live batch size and budget
really took, learnt online (Measured).
"""
import bisect
import collections
import hashlib
import itertools
import json
import statistics
import time

import torch

from ..cache import KVCache
from ..engine import Decoding
from ..io.files import atomic_write, cache_root, fingerprint, hardware
from ..sizes import MIN_BLOCK
from ..tree import Tree
from .products import BUCKETS, to_json

COST_ROWS = BUCKETS + (96, 128)  # every bucket of fast mode's products, and beyond them
WINDOW = 16  # the steps of a key (a batch size and kind, a batch size and budget) whose median is taken
OWN = 3  # steps of a batch size and budget before they price it themselves
COSTS_VERSION = 4  # bumped when the code changes what a forward costs, or how it is measured: cached ones are stale


class Measured:
    """A step's seconds at a live batch size: what steps of that batch size and budget took (its realized price),
    else a forward's by rows (measured.measure) plus what steps of that batch size and kind took beyond their
    forwards.

    A forward: a count measured slower than a larger one takes its time (fast mode then runs the product on more
    rows: products.py; else it is noise). Between measured counts a forward is interpolated, or (padded: fast mode's
    tuned products, which run a row count at its bucket's, products.BUCKETS) costs the next measured count, as 9 rows
    cost 12.

    A step: each live batch size is priced by its own steps, never another batch size's (a batch's tail, as its
    sequences stop, runs batch sizes whose steps cost what they cost, not a share of a larger batch's: RESULTS.md,
    "Why the heuristics stay"). A (batch size, budget) run OWN times is priced at its steps' median: what the
    method's step really cost, whatever rows it ran beyond the tree or left out (SDSAT's adaptive rows, BiTA's
    masks, ProPD's pruning, a step 1 with no drafts). Before, at its forward plus its kind's excess (AR's or a
    drafter's) at that batch size: what a forward of the same rows leaves out (drafting, the draft heads' products,
    verification, the host's work). A batch size with no steps of the kind: its forward alone (the planner tries it,
    then knows). Each price is the median of the last WINDOW steps of its key: a first step's warm-up or a stall of
    a few steps does not swing it.

    Prices decay as the machine drifts: each step is kept at the machine's pace when it ran (its seconds over the
    pace), and every price is read at the pace now. The pace is the median, over the last WINDOW steps with a
    realized price, of a step's seconds over that price: a price not renewed lately (drafting's, while AR is
    planned) moves with the steps that are, so a slow spell over AR steps does not make stale drafting look cheap
    (tests/test_planner.py, the drifting machine)."""

    def __init__(self, points: dict[int, float], padded: bool = False):
        rows, secs = zip(*sorted((int(r), s) for r, s in points.items()))
        self.rows, self.secs = rows, tuple(itertools.accumulate(secs[::-1], min))[::-1]
        self.padded = padded
        self.seen, self.excess = {}, {}  # (batch, drafting) -> the last WINDOW steps' excesses; their median
        self.took, self.realized = {}, {}  # (batch, budget) -> the last WINDOW steps' seconds; their median
        self.paces, self.pace = collections.deque(maxlen=WINDOW), 1.0  # steps' seconds over their prices; median

    def forward(self, rows: int) -> float:
        if self.padded and rows <= min(BUCKETS[-1], self.rows[-1]):
            return self.secs[bisect.bisect_left(self.rows, rows)]
        i = min(max(bisect.bisect_left(self.rows, rows), 1), len(self.rows) - 1)
        (r0, r1), (s0, s1) = self.rows[i - 1:i + 1], self.secs[i - 1:i + 1]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def update(self, rows: int, seconds: float, batch: int = 1, ar: bool = False, budget: int | None = None) -> None:
        """Learns from a whole step (ar: AR's; else a drafter's, even of one row per sequence), planned at budget
        (None: a price that depends on more than the budget, a nested drafter's: its excess alone)."""
        if (batch, budget) in self.realized:
            self.paces.append(seconds / self.realized[batch, budget])
            self.pace = statistics.median(self.paces)
        seconds /= self.pace  # kept at the pace it ran at
        seen = self.seen.setdefault((batch, not ar), collections.deque(maxlen=WINDOW))
        seen.append(seconds - self.forward(rows))
        self.excess[batch, not ar] = statistics.median(seen)  # once per step, not per estimate
        if budget is not None:
            took = self.took.setdefault((batch, budget), collections.deque(maxlen=WINDOW))
            took.append(seconds)
            if len(took) >= OWN:
                self.realized[batch, budget] = statistics.median(took)

    def estimate(self, rows: int, batch: int = 1, bare: bool = False, budget: int | None = None) -> float:
        """A step of `rows` rows over `batch` sequences at budget (the class docstring; bare: the forward alone)."""
        if not bare and (batch, budget) in self.realized:
            return self.realized[batch, budget] * self.pace
        excess = 0.0 if bare else self.excess.get((batch, rows > batch), 0.0)
        return max(self.forward(rows) + excess, 1e-9) * self.pace

    def basis(self, rows: int, batch: int = 1, budget: int | None = None) -> str:
        """What estimate's price is made of, for a reader (decode.py --show)."""
        if (batch, budget) in self.realized:
            return "its steps' realized price"
        return "its forward" + (" and its kind's excess" if (batch, rows > batch) in self.excess else " alone")


@torch.inference_mode()
def measure(model, exact: bool = False, rows=COST_ROWS, context: int = 256, reps: int = 5, dev=None) -> Measured:
    """Seconds per forward of n rows after `context` tokens, on this machine, model, dtype and mode:
    measured once and cached under the cache root, keyed by all four. The row counts take turns, reps
    rounds of a second or two; a count costs its median share of a round, scaled to the fastest round. A busy spell
    of a shared machine slows a whole round, which its shares do not see, and one slow forward moves one share of
    one round, where the fastest time of each count would price a count by its luckiest forward against the
    others' (their shape, which the planner's choices read, then varies from one measure to the next). dev: the
    device's layout and speed (devices.py; its forms: fast mode's product forms, the model's part of the key)."""
    w = model.embed.weight
    # the forms of the model's own products (a drafter's own shapes do not run here)
    table = None if exact or dev is None or dev.forms is None else dev.forms.only(model)
    forms = "" if table is None else "-" + hashlib.sha256(to_json(table).encode()).hexdigest()[:8]
    key = f"{fingerprint(model)}-{hardware(w.device)}-{w.dtype}-{'exact' if exact else 'fast'}{forms}-{COSTS_VERSION}"
    path = cache_root() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.is_file():
        return Measured({int(r): t for r, t in json.loads(path.read_text())["seconds"].items()}, padded=bool(forms))
    Q = max(MIN_BLOCK, *rows)
    cache = KVCache.for_model(model, context + Q + 1, dev=dev)
    dec = Decoding(model, cache, exact, Q, [0] * (context + 1), dev=dev)
    g = torch.Generator().manual_seed(0)
    dec.prefill(torch.randint(0, model.args.vocab_size, (context,), generator=g).tolist())
    blocks = {n: Tree.chain(1, [1] * (n - 1)).block(dec.cur) for n in rows}
    rounds = []
    for rep in range(reps + 1):  # the first round warms up
        took = {}
        for n, block in blocks.items():
            dec.dev.sync(dec.device)
            t0 = time.perf_counter()
            dec.run(block)
            dec.dev.sync(dec.device)
            took[n] = time.perf_counter() - t0
        if rep:
            rounds.append((sum(took.values()), took))
    fastest = min(total for total, _ in rounds)
    points = {n: fastest * statistics.median(t[n] / total for total, t in rounds) for n in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(json.dumps({"key": key, "seconds": points}, indent=1)))
    return Measured(points, padded=bool(forms))
