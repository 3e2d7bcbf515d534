"""The whole-output verdict: a run's scores at every position (forced.py) against the engine's noise (noise.py).

Three tests, each a one-sided p-value:
- count: are the run's flips more frequent than the noise's? K flips in n positions against the noise's f in
  N, conditioned on K + f: K ~ Binomial(K + f, n / (n + N)) if both come from one rate.
- early: do flips come sooner than the noise's? Per prompt, the positions up to and including its first
  flip (all of them where it has none); k' first flips in those T' positions, against the same f in N, alike.
- margin: are the flips at margins the noise explains? For each threshold t among the run's flip margins,
  k(t) flips have a margin of at least t, where the noise predicts lambda(t) = sum over positions i of
  S(max(t, gap_i)) (gap_i: the reference's top-2 gap at i; S: the noise's survival function, noise.py):
  P(Poisson(lambda(t)) >= k(t)), the smallest over thresholds times their number (Bonferroni).
The run's p is 3 x the smallest of the three (Bonferroni), at most 1; it is a divergence when p < ALPHA.
Tail probabilities are summed in log space, so a p far below float's range is still reported (as log10), down to
FLOOR (p = 0 under the noise model: a flip at a margin its survival function puts at zero).
"""
import math

from .forced import TOP_N
from .noise import survival

ALPHA = 1e-4
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
    thresholds = sorted({m for _, m in flips})
    margin, worst = 0.0, None
    for t in thresholds:
        k = sum(m >= t for _, m in flips)
        lam = sum(survival(noise, max(t, g)) for g in gaps)
        lp = log_poisson_sf(k, lam) + math.log(len(thresholds))
        if lp < margin:
            margin, worst = lp, {"threshold": t, "flips": k, "expected": lam}
    logs = {k: min(max(v, FLOOR), 0.0) for k, v in (("count", count), ("early", early), ("margin", margin))}
    log_p = min(0.0, math.log(3) + min(logs.values()))
    kl = [x for s in scores for x in s.get("kl", [])]
    out = {"verdict": "divergence" if log_p < math.log(alpha) else "pass", "alpha": alpha,
           "log10_p": log_p / math.log(10), "p": math.exp(log_p),
           "log10_p_tests": {k: v / math.log(10) for k, v in logs.items()}, "positions": n, "flips": K,
           "first_flips": firsts, "early_positions": trials, "margin_at": worst,
           "noise": {k: noise[k] for k in ("source", "positions", "flips", "kl") if k in noise}}
    if kl:
        srt = sorted(kl)
        out["kl"] = {"mean": sum(kl) / len(kl), "p99": srt[min(len(srt) - 1, int(0.99 * len(srt)))], "max": srt[-1]}
        out["top_n_same"] = sum(s.get("top_n_same", 0) for s in scores) / max(1, n)
    return out


def fmt_p(log10_p: float) -> str:
    if log10_p > -300:
        return f"{10 ** log10_p:.3g}"
    return f"1e{log10_p:.0f}" if log10_p > FLOOR / math.log(10) + 1 else f"< 1e{FLOOR / math.log(10):.0f}"


def describe(w: dict) -> str:
    """The verdict in two lines: the tests with their p-values, then the distances where the engine gave rows."""
    t, nz = w["log10_p_tests"], w["noise"]
    line = (f"  whole output: {w['positions']} positions scored by nanospec fp32: {w['flips']} flips, the first "
            f"in {w['first_flips']} prompts within {w['early_positions']} positions (noise: {nz['flips']} flips in "
            f"{nz['positions']}, {nz['source']}); p-values: count {fmt_p(t['count'])}, early {fmt_p(t['early'])}, "
            f"margin {fmt_p(t['margin'])}")
    at = w.get("margin_at")
    if at:
        line += f" ({at['flips']} flips at margins >= {at['threshold']:.3g}, the noise expects {at['expected']:.3g})"
    line += f"; p = {fmt_p(w['log10_p'])} (3 x the smallest, Bonferroni; alpha {w['alpha']:g}): {w['verdict']}"
    if "kl" in w:
        k, nk = w["kl"], nz.get("kl", {})
        line += (f"\n  distances: KL(engine || reference) over its listed ids: mean {k['mean']:.3g}, p99 "
                 f"{k['p99']:.3g}, max {k['max']:.3g} (noise: mean {nk.get('mean', 0):.3g}, p99 "
                 f"{nk.get('p99', 0):.3g}, max {nk.get('max', 0):.3g}); top-{TOP_N} ids the reference's at "
                 f"{100 * w['top_n_same']:.1f}% of positions")
    return line
