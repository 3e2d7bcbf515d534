"""RoPE, the rotary position embedding: its inverse frequencies (unscaled, or scaled linearly or as Llama 3.1 does)
and the rotation of queries and keys. The model keeps the constants (Llama.init_rope) and turns a block's positions
into angles (Llama.rope).
"""
import math

import torch

KINDS = ("default", "linear", "llama3")  # the rope_scaling types supported


def inv_freq(hd: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The inverse frequencies of a head of hd dimensions (hd // 2 of them), scaled as `scaling` says."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    kind = (scaling or {}).get("rope_type", "default")
    if kind != "llama3":
        return inv / scaling["factor"] if kind == "linear" else inv
    # llama3: frequency-dependent scaling, as in Llama 3.1
    factor, lo, hi, old = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x, cos, sin):
    """x (B, T, ..., D) rotated; cos, sin (B, T, 1, 1, D), sin signed (-sin, sin): HF's x * cos + cat(-x2, x1) * sin
    bit for bit (a negation is exact), in four ops."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
