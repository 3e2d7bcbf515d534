"""A static, preallocated KV cache of S slots for all layers.

Slot layout: 0..capacity-1 hold the sequence (committed tokens first, then the
scratch rows of the step in flight); above them sit slots reserved for keys a
method owns (e.g. BiTA's per-layer prompt keys); the last slot is the trash
slot that exact-mode padding rows write to and read from.
"""
import torch


class KVCache:
    def __init__(self, n_layers, batch, n_slots, n_kv_heads, head_dim, dtype, device):
        shape = (n_layers, batch, n_kv_heads, n_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.trash = n_slots - 1
        self.n_reserved = 0
        self.graphs = {}  # CUDA graphs captured with this cache (graphs.py): bound to its buffers

    @classmethod
    def for_model(cls, model, n_slots, batch=1):
        a, w = model.args, model.embed.weight
        return cls(a.n_layers, batch, n_slots, a.kv_heads, a.hd, w.dtype, w.device)

    @property
    def capacity(self) -> int:
        """Slots available to the sequence and the scratch rows of a step."""
        return self.n_slots - 1 - self.n_reserved

    def reset(self) -> None:
        """Empty, for a new generation; captured graphs stay valid."""
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

    def compact(self, src: list[int], dst_start: int) -> None:
        """Rollback/commit: move the entries at slots src to dst_start, dst_start+1, ... in order.

        The accepted path of a draft tree is scattered over scratch slots; this makes
        it contiguous after the committed prefix. Every other slot keeps its content.
        """
        k = 0  # entries already in place (the root, and a path along the tree's first nodes) stay
        while k < len(src) and src[k] == dst_start + k:
            k += 1
        if k == len(src):  # decided on the host: no device sync
            return
        idx = torch.tensor(src[k:], device=self.k.device)
        lo, hi = dst_start + k, dst_start + len(src)
        self.k[:, :, :, lo:hi] = self.k.index_select(3, idx)  # index_select copies first, so overlap is safe
        self.v[:, :, :, lo:hi] = self.v.index_select(3, idx)
