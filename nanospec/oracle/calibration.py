"""How far an engine's logits may move from a reference row before a flipped argmax is a bug.

The near-tie tolerance at a row is `ulps x eps(units) x scale`, scale = max(1, max |top-k logit|)
of the reference row. Without a calibration, units is the coarser float type of the two engines
and ulps is ULPS[units]: the rounding of one float type. An engine that computes otherwise
(llama.cpp multiplies quantized weights with quantized activations, and batches with other
kernels than single tokens) needs its own tolerance, measured (`nanospec.oracle.compare --engine E
--calibrate`): the engine runs teacher-forced over reference sequences, and at every position
the reference row's top-2 gap, logit[a] - logit[c], is compared with the same two logits of the
engine's row there. Positions where the engine's own argmax is not a are left out (a flip is what
the tolerance judges; it must not set it), and counted. The tolerance is then FACTOR x the
largest movement measured, as the float defaults are about 4x theirs (README).

A calibration file (schema nanospec-calibration/1, JSON):

    {"format": "nanospec-calibration/1", "engine": "llama.cpp", "engine_version": "0.3.36",
     "model": "<fingerprint of the reference's weights>", "weights": "<file or directory>",
     "prompts": 10, "max_new_tokens": 64, "factor": 4,
     "settings": {"single kv=f16": {"units": "float32", "positions": 640, "flips": 1,
                                    "max": 812.0, "p99.9": 700.0, "median": 90.0,
                                    "max_logits": 0.031, "ulps": 3248.0}, ...}}

max, p99.9 and median are in units of eps(units) x scale; max_logits is the largest movement in
logits; ulps = factor x max is the tolerance compare uses for that setting. An entry also keeps the
engine's noise sample ("noise": flips, margins at flips, every movement in logits, KL values;
noise.py), which the whole-output verdict judges that engine's runs against; an older file without
one leaves those runs to the tolerance.
"""
import json
import math
from pathlib import Path

import torch

from .. import NanospecError
from ..io.files import atomic_write

FORMAT = "nanospec-calibration/1"
FACTOR = 4
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
ULPS = {"float32": 32, "bfloat16": 8, "float16": 8}  # the defaults, calibrated on transformers: see README


def scale(pos: dict) -> float:
    return max(1.0, *(abs(v) for v in pos["top_logits"]))


def tolerance(pos: dict, dtype: str, ulps: float | None = None) -> float:
    return (ULPS[dtype] if ulps is None else ulps) * EPS[dtype] * scale(pos)


def movements(positions: list[dict], rows: torch.Tensor, units: str) -> torch.Tensor:
    """(n, 3): per reference position, how far `rows` (the engine's (n, vocab) logits at the same
    positions) move its top-2 gap, in units of eps(units) x scale; the same in logits; and 1.0
    where the engine's own argmax differs from the reference's top token (a flip)."""
    rows = torch.as_tensor(rows).float()
    ac = torch.tensor([p["top_ids"][:2] for p in positions])  # (n, 2)
    ref_gap = torch.tensor([p["top_logits"][0] - p["top_logits"][1] for p in positions], dtype=torch.float64)
    got = rows.gather(1, ac).double()
    moved = (ref_gap - (got[:, 0] - got[:, 1])).abs()
    units_of = torch.tensor([EPS[units] * scale(p) for p in positions], dtype=torch.float64)
    flips = (rows.argmax(-1) != ac[:, 0]).double()
    return torch.stack([moved / units_of, moved, flips], 1)


def entry(moves: torch.Tensor, units: str, factor: float = FACTOR) -> dict:
    """A setting's record from movements() of all its positions."""
    kept = moves[moves[:, 2] == 0]
    if not len(kept):
        raise NanospecError("calibration measured no position where the engine agrees with the reference")
    m = kept[:, 0]
    top = float(m.max())
    return {"units": units, "positions": len(moves), "flips": int(moves[:, 2].sum()), "max": round(top, 3),
            "p99.9": round(float(m.quantile(0.999)), 3), "median": round(float(m.median()), 3),
            "max_logits": float(f"{float(kept[:, 1].max()):.4g}"), "ulps": round(factor * top, 3)}


def write(path, settings: dict, **meta) -> None:
    obj = {"format": FORMAT, **meta, "factor": FACTOR, "settings": settings}
    path = Path(path)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def read(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise NanospecError(f"no calibration file at {path} (write one with --calibrate --save-calibration FILE)")
    try:
        obj = json.loads(path.read_text())
        ok = obj.get("format") == FORMAT and isinstance(obj.get("settings"), dict) and obj["settings"] and all(
            e.get("units") in EPS and isinstance(e.get("ulps"), (int, float)) and math.isfinite(e["ulps"])
            and e["ulps"] >= 0 for e in obj["settings"].values())
    except (json.JSONDecodeError, AttributeError, TypeError):
        ok = False
    if not ok:
        raise NanospecError(f"{path} is not a {FORMAT} file with settings holding units and ulps")
    return obj


def widest(cal: dict, names=None) -> dict:
    """The most lenient of the named settings (all, by default), compared in logits at scale 1."""
    names = list(cal["settings"]) if names is None else names
    missing = [n for n in names if n not in cal["settings"]]
    if missing:
        raise NanospecError(f"the calibration has no setting {missing[0]!r} (it has: {', '.join(cal['settings'])})")
    return max((cal["settings"][n] for n in names), key=lambda e: e["ulps"] * EPS[e["units"]])
