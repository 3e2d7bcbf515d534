"""The oracle's verdicts: one prompt's output against a reference (identical, near-tie, divergence,
short, empty, not-bitwise), judged on the reference's logits with the calibrated or the float
rule. compare.py's docstring defines each; the engines (engines/) and compare's command line use
this module, which imports no engine."""
from .. import NanospecError
from .calibration import EPS, tolerance


def coarser(*dtypes) -> str:
    known = [d for d in dtypes if d]
    for d in known:
        if d not in EPS:
            raise NanospecError(f"unknown dtype {d!r}: one of {', '.join(EPS)}")
    return max(known, key=EPS.get)


def compare_one(ref: dict, other: dict, dtype: str, ulps: float | None = None, bitwise: bool = False) -> dict:
    """One prompt's verdict (see the module docstring)."""
    a_ids, b_ids = ref["output_ids"], other["output_ids"]
    n = min(len(a_ids), len(b_ids))
    res = {"compared": n, "reference_len": len(a_ids), "other_len": len(b_ids)}
    if not b_ids:
        return {**res, "verdict": "empty"}
    i = next((i for i in range(n) if a_ids[i] != b_ids[i]), None)
    if i is None:
        eos = other.get("eos_id", ref.get("eos_id"))
        if len(b_ids) < len(a_ids) and b_ids[-1] != eos:
            return {**res, "verdict": "short", "position": len(b_ids), "reference_next": a_ids[len(b_ids)]}
        res["verdict"] = "identical"
        if hashed(other):
            rows = list(zip(ref["positions"][:n], other["positions"]))
            j = next((j for j, (p, q) in enumerate(rows) if p["sha256"] != q.get("sha256")), None)
            res["bitwise"] = j is None
            if j is not None:
                res.update(position=j, max_abs_diff=traced_difference(*rows[j]))
                if bitwise:
                    res["verdict"] = "not-bitwise"
        return res
    pos, a, b = ref["positions"][i], a_ids[i], b_ids[i]
    top = dict(zip(pos["top_ids"], pos["top_logits"]))
    tol = tolerance(pos, dtype, ulps)
    gap = top[a] - top[b] if a in top and b in top else None
    res.update(position=i, reference_token=a, other_token=b, margin=pos["top_logits"][0] - pos["top_logits"][1],
               gap=gap, tolerance=tol, verdict="near-tie" if gap is not None and gap <= tol else "divergence")
    return res


def hashed(entry: dict) -> bool:
    """A full trace (each row's sha256), not just an engine's top-k rows."""
    return all("sha256" in q for q in entry.get("positions", [{}]))


def traced_difference(p: dict, q: dict) -> float:
    """The largest |difference| between two positions' traced values: the logits of the ids both
    list in their top-k, and the log-sum-exp."""
    a, b = dict(zip(p["top_ids"], p["top_logits"])), dict(zip(q.get("top_ids", []), q.get("top_logits", [])))
    diffs = [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    if "lse" in q:
        diffs.append(abs(p["lse"] - q["lse"]))
    return max(diffs, default=float("nan"))


def compare(refs: list[dict], others: list[dict], dtype: str | None = None, ulps: float | None = None,
            bitwise: bool = False, units: str | None = None) -> list[dict]:
    """Every OTHER entry's verdict against the reference entry with its prompt_ids. units: a
    calibration's units, used as they are (else the coarser of the two dtypes and dtype)."""
    index = {tuple(r["prompt_ids"]): r for r in refs}
    fps = {r.get("model") for r in refs} | {o.get("model") for o in others}
    if len(fps - {None}) > 1:
        raise NanospecError("the two traces come from different weights (their \"model\" fingerprints differ)")
    if bitwise and not all(map(hashed, others)):
        raise NanospecError("--bitwise needs a full trace (decode.py --trace) on both sides")
    results = []
    for k, o in enumerate(others):
        ref = index.get(tuple(o["prompt_ids"]))
        if ref is None:
            raise NanospecError(f"line {k + 1} of the other output has prompt_ids that the reference does not "
                                "trace: trace the same prompts with decode.py --trace")
        if ref.get("temperature", 0.0):
            raise NanospecError("the reference was sampled (temperature > 0): compare needs a greedy trace")
        d = units or coarser(ref.get("dtype", "float32"), o.get("dtype"), dtype)
        results.append({"prompt": k, "dtype": d, **compare_one(ref, o, d, ulps, bitwise)})
    return results


VERDICTS = ("identical", "near-tie", "divergence", "short", "empty", "not-bitwise")


def summary(results: list[dict]) -> dict:
    count = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
    bitwise = [r["bitwise"] for r in results if "bitwise" in r]
    return {"prompts": len(results), **count, **({"bitwise": sum(bitwise)} if bitwise else {})}


def failed(s: dict, allow_short: bool = False) -> bool:
    """Whether a run's summary fails it: a divergence, an empty output, a short one (unless
    allowed) or, under --bitwise, a row that differs in any bit."""
    return bool(s["divergence"] or s["empty"] or s["not-bitwise"] or (s["short"] and not allow_short))
