"""The whole-output verdict: a run's scores at every position (forced.py) against the engine's noise (noise.py).

Four tests, each a one-sided p-value:
- count: are the run's flips more frequent than the noise's? K flips in n positions against the noise's f in
  N, conditioned on K + f: K ~ Binomial(K + f, n / (n + N)) if both come from one rate.
- early: do flips come sooner than the noise's? Per prompt, the positions up to and including its first
  flip (all of them where it has none); k' first flips in those T' positions, against the same f in N, alike.
- margin: are the flips at margins the noise explains? For each threshold t among the run's flip margins,
  k(t) flips have a margin of at least t, where the noise predicts lambda(t) = sum over positions i of
  S(max(t, gap_i)) (gap_i: the reference's top-2 gap at i; S: the noise's survival function, noise.py):
  P(Poisson(lambda(t)) >= k(t)), the smallest over thresholds times their number (Bonferroni).
- distance: where the engine gave rows, do its distributions sit further from the reference's than the noise's
  do? Two statistics at the same truncation k (the largest of forced.KS the run lists at every position): the
  mean KL over the run's positions, and the share of positions whose top-N ids are not the reference's (plus one,
  so that none is not zero), each as a log ratio to the noise's. Positions within a prompt are not independent,
  so the ratio's spread is measured by resampling prompts (RESAMPLES draws): paired with the noise's sample of
  the same prompt where every prompt has one (the noise measured on the run's prompts), else run and noise
  drawn apart. Its p is Student's t tail of log ratio / spread with (prompts - 1) degrees of freedom, twice the
  smaller of the two (Bonferroni). A run of ids alone has no distance test, and says so.
The run's p is 4 x the smallest of the four (Bonferroni), at most 1; it is a divergence when p < ALPHA.
Tail probabilities are summed in log space, so a p far below float's range is still reported (as log10), down to
FLOOR (p = 0 under the noise model: a flip at a margin its survival function puts at zero).
"""
import math

import torch

from .forced import KS, TOP_N
from .noise import survival

ALPHA = 1e-4
TESTS = ("count", "early", "margin", "distance")
RESAMPLES = 2000
FLOOR = -1e6  # log p below this (p = 0 under the noise model, or near it) is reported as this, a finite number


def log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))


def log_binom_sf(k: int, n: int, q: float) -> float:
    """log P(Binomial(n, q) >= k)."""
    if k <= 0:
        return 0.0
    if k > n or q <= 0:
        return -math.inf
    if q >= 1:
        return 0.0
    out = -math.inf
    for x in range(k, n + 1):
        term = math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1) + x * math.log(q) \
            + (n - x) * math.log1p(-q)
        out = log_add(out, term)
    return min(out, 0.0)


def log_poisson_sf(k: int, lam: float) -> float:
    """log P(Poisson(lam) >= k)."""
    if k <= 0:
        return 0.0
    if lam <= 0:
        return -math.inf
    out, x, term = -math.inf, k, -lam + k * math.log(lam) - math.lgamma(k + 1)
    while True:
        out = log_add(out, term)
        x += 1
        term += math.log(lam) - math.log(x)
        if term < out - 40 and x > lam:
            return min(out, 0.0)


def log_beta_inc(x: float, a: float, b: float) -> float:
    """log I_x(a, b), the regularized incomplete beta function (Lentz's continued fraction; x < (a+1)/(a+b+2))."""
    if x <= 0:
        return -math.inf
    front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) - math.log(a)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d, c = 1 + num * d, 1 + num / c
            d, c = 1 / (d if abs(d) > tiny else tiny), c if abs(c) > tiny else tiny
            f *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return front + math.log(f)


def log_t_sf(t: float, df: int) -> float:
    """log P(T >= t) for Student's t with df degrees of freedom."""
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return -math.inf
    x, a = df / (df + t * t), df / 2
    if x < (a + 1) / (a + 1.5 + 1):
        return math.log(0.5) + log_beta_inc(x, a, 0.5)
    return math.log(0.5) + math.log1p(-math.exp(log_beta_inc(1 - x, 0.5, a)))


def distance(scores: list[dict], noise: dict, alpha: float = ALPHA) -> dict | None:
    """The distance test (module docstring): None where the run or the noise has no distances to compare."""
    run = [s for s in scores if s.get("distances")]
    noise_d = noise.get("distances") or []
    common = [k for k in KS if run and noise_d and all(str(k) in d for d in [s["distances"] for s in run] + noise_d)]
    if not common:
        return None
    k = str(common[-1])
    by_key = {d["key"]: d for d in noise_d}
    paired = all(s.get("key") in by_key for s in run)  # the noise has a sample of every prompt of the run
    mine = torch.tensor([stats(s["distances"][k]) for s in run], dtype=torch.float64)  # (P, 3)
    theirs = torch.tensor([stats(by_key[s["key"]][k]) for s in run] if paired else [stats(d[k]) for d in noise_d],
                          dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    i = torch.randint(len(mine), (RESAMPLES, len(mine)), generator=g)
    j = i if paired else torch.randint(len(theirs), (RESAMPLES, len(theirs)), generator=g)
    ratio = lambda a, b: log_rates(a) - log_rates(b)  # (..., 2): log KL ratio, log disagreement ratio
    obs, spread = ratio(mine.sum(0), theirs.sum(0)), ratio(mine[i].sum(1), theirs[j].sum(1)).std(0)
    df = (len(mine) if paired else min(len(mine), len(theirs))) - 1
    t = [float(o / sp) if sp > 0 else (math.inf if o > 0 else 0.0) for o, sp in zip(obs, spread)]
    log_p = min(0.0, math.log(2) + min(log_t_sf(x, df) for x in t)) if df > 0 else 0.0
    crit = critical_t(math.log(alpha / (2 * len(TESTS))), df) if df > 0 else math.inf  # one prompt: no spread
    n_run, n_noise = float(mine[:, 2].sum()), float(theirs[:, 2].sum())
    return {"k": int(k), "paired": paired, "prompts": len(mine), "log_p": log_p,
            "kl_mean": float(mine[:, 0].sum()) / n_run, "noise_kl_mean": float(theirs[:, 0].sum()) / n_noise,
            "top_n_same": 1 - float(mine[:, 1].sum()) / n_run,
            "noise_top_n_same": 1 - float(theirs[:, 1].sum()) / n_noise,
            "kl_ratio": math.exp(float(obs[0])),
            "smallest_flagged_ratio": math.exp(min(700.0, float(spread[0]) * crit)) if df > 0 else math.inf}


def stats(d: dict) -> list[float]:
    """A prompt's (sum of KL, positions whose top-N ids are not the reference's, positions) at one k."""
    return [sum(d["kl"]), len(d["same"]) - sum(d["same"]), len(d["kl"])]


def log_rates(x: torch.Tensor) -> torch.Tensor:
    """(..., 3) sums as (..., 2) log rates: mean KL, and the disagreement share with one added."""
    return torch.stack((x[..., 0] / x[..., 2], (x[..., 1] + 1) / x[..., 2]), -1).log()


def critical_t(log_level: float, df: int) -> float:
    """The t whose tail is exp(log_level), by bisection."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log_t_sf(mid, df) > log_level else (lo, mid)
    return hi


def test(scores: list[dict], noise: dict, alpha: float = ALPHA) -> dict:
    """The run's verdict from its prompts' scores (forced.score) against a noise model (noise.merge)."""
    n = sum(s["positions"] for s in scores)
    flips = [f for s in scores for f in s["flips"]]
    f, N = noise["flips"], noise["positions"]
    K = len(flips)
    count = log_binom_sf(K, K + f, n / (n + N)) if n else 0.0
    trials = sum(s["flips"][0][0] + 1 if s["flips"] else s["positions"] for s in scores)
    firsts = sum(bool(s["flips"]) for s in scores)
    early = log_binom_sf(firsts, firsts + f, trials / (trials + N)) if trials else 0.0
    gaps = [g for s in scores for g in s["gaps"]]
    thresholds = sorted({m for _, m in flips}) if noise["movements"] else []  # no movements known: untested
    margin, worst = 0.0, None
    for t in thresholds:
        k = sum(m >= t for _, m in flips)
        lam = sum(survival(noise, max(t, g)) for g in gaps)
        lp = log_poisson_sf(k, lam) + math.log(len(thresholds))
        if lp < margin:
            margin, worst = lp, {"threshold": t, "flips": k, "expected": lam}
    dist = distance(scores, noise, alpha)
    tests = (("count", count), ("early", early), ("margin", margin), ("distance", dist["log_p"] if dist else 0.0))
    logs = {k: min(max(v, FLOOR), 0.0) for k, v in tests}
    log_p = min(0.0, math.log(len(TESTS)) + min(logs.values()))
    out = {"verdict": "divergence" if log_p < math.log(alpha) else "pass", "alpha": alpha,
           "log10_p": log_p / math.log(10), "p": math.exp(log_p),
           "log10_p_tests": {k: v / math.log(10) for k, v in logs.items()}, "positions": n, "flips": K,
           "first_flips": firsts, "early_positions": trials, "margin_at": worst,
           "noise": {k: noise[k] for k in ("source", "positions", "flips") if k in noise}, "distance": dist}
    return out


def fmt_p(log10_p: float) -> str:
    if log10_p > -300:
        return f"{10 ** log10_p:.3g}"
    return f"1e{log10_p:.0f}" if log10_p > FLOOR / math.log(10) + 1 else f"< 1e{FLOOR / math.log(10):.0f}"


def describe(w: dict) -> str:
    """The verdict in two lines: the tests with their p-values, then the distances where the engine gave rows (or
    that it gave none)."""
    t, nz, d = w["log10_p_tests"], w["noise"], w.get("distance")
    line = (f"  whole output: {w['positions']} positions scored by nanospec fp32: {w['flips']} flips, the first "
            f"in {w['first_flips']} prompts within {w['early_positions']} positions (noise: {nz['flips']} flips in "
            f"{nz['positions']}, {nz['source']}); p-values: count {fmt_p(t['count'])}, early {fmt_p(t['early'])}, "
            f"margin {fmt_p(t['margin'])}, distance {fmt_p(t['distance']) if d else 'untested'}")
    at = w.get("margin_at")
    if at:
        line += f" ({at['flips']} flips at margins >= {at['threshold']:.3g}, the noise expects {at['expected']:.3g})"
    line += (f"; p = {fmt_p(w['log10_p'])} ({len(TESTS)} x the smallest, Bonferroni; alpha {w['alpha']:g}): "
             f"{w['verdict']}")
    if d is None:
        return line + ("\n  distances: none (the engine gave ids only, or its noise keeps no distances): a bug that "
                       "moves the distributions but flips no more argmaxes than the noise goes unseen")
    n = min(TOP_N, d["k"])
    return line + (f"\n  distances at the top {d['k']} ids ({d['prompts']} prompts, "
                   f"{'paired with the noise' if d['paired'] else 'against the noise'}): mean KL(engine || "
                   f"reference) {d['kl_mean']:.3g} against the noise's {d['noise_kl_mean']:.3g} "
                   f"(x{d['kl_ratio']:.3g}); "
                   f"top-{n} ids the reference's at {100 * d['top_n_same']:.1f}% of positions against "
                   f"{100 * d['noise_top_n_same']:.1f}%; this run flags a mean KL of x{d['smallest_flagged_ratio']:.3g}"
                   f" the noise's or more")


SEES_LITTLE = 10.0  # a run that cannot flag a mean KL ten times the noise's misses the subtle classes (plants.py)


def caveat(w: dict) -> str | None:
    """One closing line where a run could see little, so that its pass does not read like a proof."""
    d = w.get("distance")
    if d is None:
        return ("  this run could see little: ids only, so only bugs that flip argmaxes beyond the noise's are "
                "caught (give the engine's top-k rows or logprobs to test the distances)")
    if d["smallest_flagged_ratio"] > SEES_LITTLE:
        return (f"  this run could see little: on {d['prompts']} prompts it flags only a mean KL of "
                f"x{d['smallest_flagged_ratio']:.3g} the noise's or more (more prompts narrow it)")
    return None
