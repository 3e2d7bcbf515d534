"""RoPE's inverse frequencies: unscaled, or scaled linearly or as Llama 3.1 does. The model keeps the constants
(model.Llama.init_rope), forward.angles turns a block's positions into angles, and model.apply_rope rotates queries
and keys.
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
