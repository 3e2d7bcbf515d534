"""The noise model: what a correct engine moves, as a distribution, for the whole-output test (whole.py).

A noise sample is measured teacher-forced: a correct engine's rows (or nanospec's at another dtype) at the
positions of reference sequences, against the reference's rows there (its top-k ids and logits). It keeps:
- positions, prompts and flips: how often the correct engine's argmax leaves the reference's;
- flip_margins: at those flips, the reference's top logit minus its logit for the engine's argmax;
- movements: at every position, how far the engine moved the reference's top-2 gap, in logits (sorted): the
  margin test's survival function, S(m) = the share of positions moved by at least m, is read from them, and
  past their 90th percentile it is an exponential tail fitted to the excesses there (a flip at a margin
  beyond every measured movement is then explained with a small but stated probability, not with zero);
- distances: per prompt (named by forced.prompt_key), at each truncation k of forced.KS, every position's KL of
  the engine's distribution from the reference's over the engine's top k ids and whether its top-N ids are the
  reference's (forced.distances): the same numbers a run's scores keep, so that whole.py's distance test compares
  like with like, and resamples them by prompt.

Where it comes from: an engine's calibration (--calibrate writes one per setting), else measured on the spot,
nanospec itself at the engine's dtype against nanospec fp32, on the run's own prompts (for fp32: nanospec's
fast-mode forward against exact AR's rows). An engine that computes more coarsely than its dtype says (a
quantized server, llama.cpp's quantized activations) left uncalibrated at --dtype float32 is judged against
fp32 noise and false-alarms: calibrate it (--engine llama.cpp --calibrate) or pass its dtype (--dtype bfloat16).
"""
import math

import torch

from . import forced


def positions_of(rows: torch.Tensor, k: int = 8) -> list[dict]:
    """Full rows as a trace's positions: top-k ids and logits, largest first."""
    top = rows.float().topk(min(k, rows.shape[-1]), -1)
    return [{"top_ids": i.tolist(), "top_logits": v.tolist()} for i, v in zip(top.indices, top.values)]


def sample(positions: list[dict], rows: torch.Tensor, ref: torch.Tensor | None = None, key: str | None = None) -> dict:
    """One prompt's noise: a correct engine's rows (n, vocab) against the reference's positions (top-k); ref: the
    reference's full rows, where known (else its positions stand in for them in the distances)."""
    rows = torch.as_tensor(rows).float()
    flips, moves = [], []
    for i, (p, row) in enumerate(zip(positions, rows)):
        ids, vals = p["top_ids"], p["top_logits"]
        b = int(row.argmax())
        if b != ids[0]:  # the margin of a token past the listed ones is at least the last listed one's
            flips.append(vals[0] - (vals[ids.index(b)] if b in ids else vals[-1]))
        if len(ids) > 1:
            moves.append(abs((vals[0] - vals[1]) - float(row[ids[0]] - row[ids[1]])))
    d = forced.distances(positions if ref is None else ref, positions_of(rows, max(forced.KS)))
    return {"positions": len(rows), "prompts": 1, "flips": len(flips), "flip_margins": flips, "movements": moves,
            "distances": [{"key": key, **d}]}


def merge(samples: list[dict], source: str) -> dict:
    """Samples (of prompts, or of settings) as one noise model."""
    cat = lambda f: sorted(float(f"{x:.4g}") for s in samples for x in s[f])
    dist = [d for s in samples for d in s.get("distances", [])]
    return {"source": source, "positions": sum(s["positions"] for s in samples),
            "prompts": sum(s["prompts"] for s in samples), "flips": sum(s["flips"] for s in samples),
            "flip_margins": cat("flip_margins"), "movements": cat("movements"), "distances": dist}


def from_calibration(entries: list[dict], source: str) -> dict | None:
    """The noise of calibration entries (the samples they keep), None where one keeps none (an older file)."""
    kept = [e.get("noise") for e in entries]
    return None if not kept or None in kept else merge(kept, source)


def from_scores(scores: list[dict], source: str) -> dict:
    """A run's scores (forced.score) as the noise another run is judged against: an engine's own plain run, for
    its speculative run (what speculation adds to the engine's own distance from the reference is then tested,
    and its quantization's cancels). Its movements are the rows' (none where the run gave ids only)."""
    return {"source": source, "positions": sum(s["positions"] for s in scores), "prompts": len(scores),
            "flips": sum(len(s["flips"]) for s in scores),
            "flip_margins": sorted(m for s in scores for _, m in s["flips"]),
            "movements": sorted(x for s in scores for x in s.get("movements", [])),
            "distances": [{"key": s["key"], **s["distances"]} for s in scores if s.get("distances")]}


def survival(noise: dict, m: float) -> float:
    """S(m): the probability that the noise moves a position's top-2 gap by at least m logits (docstring)."""
    mv = noise["movements"]
    if m <= 0 or not mv:
        return 1.0 if m <= 0 else 0.0
    q = mv[min(len(mv) - 1, int(0.9 * len(mv)))]
    if m <= q:
        return sum(x >= m for x in mv) / len(mv)
    excess = [x - q for x in mv if x > q]
    b = max(sum(excess) / len(excess) if excess else 0.0, 1e-12)
    return 0.1 * math.exp(-(m - q) / b)


@torch.no_grad()
def measure(reference, model, entries: list[dict], exact_rows: bool, source: str) -> dict:
    """Noise on the spot: `model` (nanospec at the engine's dtype) against `reference` (nanospec fp32),
    teacher-forced over the entries' sequences. exact_rows: the entries are fp32 exact AR traces, and their
    positions are the reference's rows (fp32 noise: the fast-mode forward against exact AR's rows)."""
    samples = []
    for e in entries:
        if not e["output_ids"]:
            continue
        d = forced.rows(model, e["prompt_ids"], e["output_ids"])
        full = forced.rows(reference, e["prompt_ids"], e["output_ids"])
        ref = e["positions"] if exact_rows else positions_of(full)
        samples.append(sample(ref, d, full, forced.prompt_key(e["prompt_ids"])))
    return merge(samples, source)
