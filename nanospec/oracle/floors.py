"""Detection floors: the smallest planted bug of each class (plants.py) that a noise model still flags.

Each class is planted at increasing strength in the model under test (at the dtype its noise was measured in),
teacher-forced over the reference's sequences, and its rows scored against the reference's (forced.score: the
planted model's argmax as the engine's token) and judged by whole.test against the noise. A class's floor is the
weakest strength flagged, found by bisection over its ladder (STRENGTHS, weakest first; a stronger bug flags at
least as surely); classes that the model does not have (a rope_scaling, q/k norms, a window, a BOS) are
reported as such.
"""
import torch

from . import forced, plants, whole

STRENGTHS = {"rope_base": [1.001, 1.003, 1.01, 1.03, 1.1, 1.3, 2.0, 4.0, 10.0],
             "norm_eps": [10.0, 100.0, 1e3, 1e4, 1e5, 1e6],
             "rejected_key": [64, 32, 16, 8, 4, 2]}
LABELS = {"rope_base": "rope base /{:g}", "norm_eps": "eps x{:g}", "rejected_key": "rejected key every {:g} steps",
          "rope_scaling": "rope scaling left out", "qk_norm": "q/k norm left out",
          "window": "window one key longer", "bos": "BOS left out"}


def flagged(model, cls: str, strength: float, paths: list[tuple], noise: dict, alpha: float) -> bool:
    """Whether a class at a strength is a divergence against the noise; paths: (prompt, tokens, ref_rows)."""
    scores = []
    for prompt, tokens, ref in paths:
        rows = plants.forced_rows(model, cls, strength, prompt, tokens, ref)
        scores.append(forced.score(ref, rows.argmax(-1).tolist()))
    return whole.test(scores, noise, alpha)["verdict"] == "divergence"


def floors(model, reference, entries: list[dict], noise: dict, alpha: float = whole.ALPHA) -> dict:
    """{class: label of its floor, or why there is none}; model: the planted model (the noise's dtype),
    reference: nanospec fp32, entries: the reference's traces (their sequences are forced)."""
    entries = [e for e in entries if e["output_ids"]]
    with torch.no_grad():
        paths = [(e["prompt_ids"], e["output_ids"], forced.rows(reference, e["prompt_ids"], e["output_ids"]))
                 for e in entries]
    out = {}
    for cls in plants.CLASSES:
        if not plants.applies(cls, model, entries[0]["prompt_ids"] if entries else None):
            out[cls] = "n/a"
            continue
        ladder = STRENGTHS.get(cls, [1.0])
        lo, hi = 0, len(ladder)  # the weakest flagged is in ladder[lo:hi], or none (hi == len)
        while lo < hi:
            mid = (lo + hi) // 2
            if flagged(model, cls, ladder[mid], paths, noise, alpha):
                hi = mid
            else:
                lo = mid + 1
        if lo == len(ladder):
            out[cls] = (f"not flagged up to {LABELS[cls].format(ladder[-1])}" if cls in STRENGTHS
                        else f"{LABELS[cls]}: not flagged")
        else:
            out[cls] = LABELS[cls].format(ladder[lo])
    return out


def describe(found: dict, source: str) -> str:
    absent = [LABELS[k].removesuffix(" left out").removesuffix(" one key longer") for k, v in found.items()
              if v == "n/a"]
    return (f"  detection floor ({source}): " + ", ".join(v for v in found.values() if v != "n/a")
            + (f" (not in this model or its prompts: {', '.join(absent)})" if absent else ""))
