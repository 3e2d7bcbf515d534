"""Exact and fast mode's static KV cache: slots per sequence and layer, a method's reserved slots, a trash slot
for padding rows, and rollback that moves a step's accepted entries into place."""
import torch

from . import devices


class KVCache:
    """A static KV cache, S slots per sequence and layer: 0..capacity-1 hold the sequence (committed tokens, then a
    step's scratch rows), then a method's reserved slots (BiTA's prompt keys), last the trash slot padding rows use."""

    def __init__(self, n_layers, batch, n_slots, n_kv_heads, head_dim, dtype, device, grain=(1, 1)):
        """grain: the multiples of (slots, head width) its buffers are laid out at (a device's exact layout,
        devices.Device.grain): the padding slots are never visible, the padding columns stay zero."""
        shape = (n_layers, batch, n_kv_heads, n_slots - n_slots % -grain[0], head_dim - head_dim % -grain[1])
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.n_slots, self.trash, self.n_reserved = n_slots, n_slots - 1, 0

    @classmethod
    def for_model(cls, model, n_slots, batch=1, dev=None):
        """dev: the device whose exact layout it takes (default: devices.of the model's)."""
        a, w = model.args, model.embed.weight
        return cls(a.n_layers, batch, n_slots, a.kv_heads, a.hd, w.dtype, w.device, devices.of(dev or w).grain(w.dtype))

    @property
    def capacity(self) -> int:
        """Slots available to the sequence and the scratch rows of a step."""
        return self.n_slots - 1 - self.n_reserved

    def reset(self) -> None:
        """Empty, for a new generation (its buffers stay: what a captured program is bound to)."""
        self.k.zero_()
        self.v.zero_()
        self.n_reserved = 0

    def layer(self, i):
        return self.k[i], self.v[i]  # each (B, Hkv, S, D), views: writes land in the cache

    def reserve(self, n: int) -> torch.Tensor:
        """Claim n slots for method-owned keys, just below the trash slot."""
        if n > self.capacity - 1:
            raise ValueError(f"cannot reserve {n} of {self.n_slots} cache slots")
        self.n_reserved += n
        return torch.arange(self.capacity, self.capacity + n)  # host tensor, like the blocks that use it

    def compact(self, src: list[int], dst_start: int, seq: int = 0) -> None:
        """Rollback/commit of sequence seq: move the entries at slots src to dst_start, dst_start+1, ...
        in order (the accepted path, scattered over scratch slots, after the prefix); every other slot stays."""
        # entries already in place (the root, and a path along the tree's first nodes) stay
        k = next((i for i, s in enumerate(src) if s != dst_start + i), len(src))
        if k == len(src):  # decided on the host: no device sync
            return
        idx = torch.tensor(src[k:], device=self.k.device)
        lo, hi = dst_start + k, dst_start + len(src)
        for c in (self.k[:, seq], self.v[:, seq]):  # (layers, Hkv, S, D) views
            c[:, :, lo:hi] = c.index_select(2, idx)  # index_select copies first, so overlap is safe

    def settle(self, seqs: torch.Tensor, cur: torch.Tensor, path: torch.Tensor) -> None:
        """The commit's moves of a batch's step, on the device: each sequence's accepted path (node i at slot cur + i,
        -1 padded) moved to slots cur, cur+1, ... of its cache row (seqs), every layer at once (past the path's end,
        the trash slot onto itself: a path's padding may reach past the cache's last slot)."""
        dst = torch.where(path >= 0, cur[:, None] + torch.arange(path.shape[-1], device=path.device), self.trash)
        src = torch.where(path >= 0, cur[:, None] + path, self.trash)  # (B, E)
        for c in (self.k, self.v):  # (layers, B, Hkv, S, D): the gather copies first, so overlap is safe
            c[:, seqs[:, None], :, dst] = c[:, seqs[:, None], :, src]
