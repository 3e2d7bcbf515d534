"""Traces: nanospec's reference output for other engines to be checked against.

`decode.py --trace FILE.jsonl` writes one JSON object per prompt (schema `nanospec-trace/1`):

    {"format": "nanospec-trace/1", "method": "ar", "mode": "exact", "dtype": "float32",
     "device": "cpu", "model": "<fingerprint of the weights>", "eos_id": 2, "temperature": 0.0,
     "prompt_ids": [...], "output_ids": [...],
     "positions": [{"top_ids": [...], "top_logits": [...], "lse": 12.3, "sha256": "..."}, ...]}

positions[i] describes the logit row output_ids[i] came from, as fp32: its k largest logits
(ids and values, largest first; k=8 by default), its log-sum-exp (computed in fp64) and the
sha256 of the row's fp32 bytes (little-endian), so two traces can be checked for bitwise
equal logits without shipping the rows. The reference is AR in exact mode.
"""
import hashlib
import json
from pathlib import Path

import torch

from .. import NanospecError
from ..io.files import atomic_write

FORMAT = "nanospec-trace/1"


def record(prompt: list[int], tokens: list[int], logits: torch.Tensor, k: int = 8, **meta) -> dict:
    """One prompt's trace entry; logits: (len(tokens), vocab), the rows the tokens came from."""
    rows = logits.float().cpu().contiguous()
    top = rows.topk(min(k, rows.shape[-1]), -1)
    lse = torch.logsumexp(rows.double(), -1)
    positions = [{"top_ids": i.tolist(), "top_logits": v.tolist(), "lse": float(s),
                  "sha256": hashlib.sha256(r.numpy().astype("<f4").tobytes()).hexdigest()}
                 for i, v, s, r in zip(top.indices, top.values, lse, rows)]
    return {"format": FORMAT, **meta, "prompt_ids": list(prompt), "output_ids": list(tokens), "positions": positions}


def write(path, entries: list[dict]) -> None:
    path = Path(path)
    text = "".join(json.dumps(e) + "\n" for e in entries)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def read(path, full: bool = False) -> list[dict]:
    """JSONL lines with at least prompt_ids and output_ids (full=True: a nanospec trace)."""
    path = Path(path)
    if not path.is_file():
        raise NanospecError(f"no trace at {path}")
    entries = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            ok = isinstance(e, dict) and all(isinstance(e.get(f), list) for f in ("prompt_ids", "output_ids"))
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise NanospecError(f"{path}:{i} is not a JSON object with prompt_ids and output_ids lists")
        if full and (e.get("format") != FORMAT or len(e.get("positions", [])) != len(e["output_ids"])):
            raise NanospecError(f"{path}:{i} is not a {FORMAT} line (write one with decode.py --trace)")
        entries.append(e)
    if not entries:
        raise NanospecError(f"{path} holds no traces")
    return entries
