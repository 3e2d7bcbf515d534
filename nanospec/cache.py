"""Exact and fast mode's static KV cache, and the Block of rows a forward writes to it and reads from it.

KVCache: slots per sequence and layer, a method's reserved slots, a trash slot for padding rows, and the commit that
moves a step's accepted entries into place. Block: the rows of one forward, each with its position, its cache slot
and the slots it sees. The model (model.py) computes a block; the trees (tree.py) and the engine lay blocks out, on
the host, and the engine stacks a batch's sequences' blocks into one (each sequence its own cache row). Exact mode
pads a block to a fixed shape (Block.pad), so that its forward's shapes are the same every step. A forward's host
inputs, a block's and its nodes', travel to the device as one tensor (packed).
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from . import devices


class KVCache:
    """A static KV cache, S slots per sequence and layer: 0..capacity-1 hold the sequence (committed tokens, then a
    step's scratch rows), then a method's reserved slots (BiTA's prompt keys), last the trash slot padding rows use."""

    def __init__(self, n_layers, batch, n_slots, n_kv_heads, head_dim, dtype, device, grain=(1, 1)):
        """grain: the multiples of (slots, head width) its buffers are laid out at (a device's exact layout,
        devices.Device.grain): the padding slots are never visible, the padding columns stay zero."""
        shape = (n_layers, 2, batch, n_kv_heads, n_slots - n_slots % -grain[0], head_dim - head_dim % -grain[1])
        self.kv = torch.zeros(shape, dtype=dtype, device=device)  # keys and values: a layer's written in one copy
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]  # views (layers, B, Hkv, S, D)
        self.arange = torch.arange(max(shape[-2] + 1, batch, n_kv_heads), device=device)  # a program's indices: views
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
        self.kv.zero_()
        self.n_reserved = 0

    def reserve(self, n: int) -> torch.Tensor:
        """Claim n slots for method-owned keys, just below the trash slot."""
        if n > self.capacity - 1:
            raise ValueError(f"cannot reserve {n} of {self.n_slots} cache slots")
        self.n_reserved += n
        return torch.arange(self.capacity, self.capacity + n)  # host tensor, like the blocks that use it

    def write_reserved(self, cache_row: int, slots: torch.Tensor, keys, values) -> None:
        """Per-layer keys and values (P of them a head) written to cache_row's slots (a method's reserved ones)."""
        for i, kv in enumerate(zip(keys, values)):
            for j, x in enumerate(kv):  # a cache's head width may be padded
                self.kv[i, j, cache_row:cache_row + 1, :, slots.to(self.kv.device), :x.shape[-1]] = x

    def commit(self, cache_rows: torch.Tensor, cur: torch.Tensor, path: torch.Tensor) -> None:
        """A step's accepted keys kept, on the device, for greedy and sampled steps alike: each sequence's accepted
        path (node i at slot cur + i, -1 padded) moved to slots cur, cur+1, ... of its cache row (cache_rows), every
        layer at once (past the path's end, the trash slot onto itself: a path's padding may reach past the last
        slot)."""
        kept, trash = path >= 0, self.arange[self.trash]
        dst, src = (torch.where(kept, cur[:, None] + i, trash) for i in (self.arange[:path.shape[-1]], path))  # (B, E)
        kv = self.kv  # (layers, 2, B, Hkv, S, D): the gather copies first, so overlap is safe
        kv[:, :, cache_rows[:, None], :, dst] = kv[:, :, cache_rows[:, None], :, src]


@dataclass
class Block:
    """T rows of one forward for each of B sequences (a batch: each sequence its own cache row)."""
    tokens: torch.Tensor  # (B, T) token ids (ignored for rows fed as embeddings)
    pos: torch.Tensor     # (B, T) RoPE positions
    slots: torch.Tensor   # (T,) or per sequence (B, T): the cache slot each row writes its key/value to
    committed: torch.Tensor  # (B, T) each row sees committed slots 0..committed-1 ...
    extra: torch.Tensor   # (B, T, E) ... then these slots, in this order (-1 = none)

    def __len__(self):
        return self.slots.shape[-1]

    @staticmethod
    def cat(*blocks: "Block") -> "Block":
        E = max(b.extra.shape[-1] for b in blocks)
        cat = lambda f, dim=1: torch.cat([getattr(b, f) for b in blocks], dim)
        extra = torch.cat([F.pad(b.extra, (0, E - b.extra.shape[-1]), value=-1) for b in blocks], 1)
        return Block(cat("tokens"), cat("pos"), cat("slots", -1), cat("committed"), extra)

    @staticmethod
    def stack(blocks: list["Block"], trash: int) -> "Block":
        """Blocks of one sequence each as one batch, each padded to the longest (exact mode's are Q rows already):
        a padding row writes the trash slot and sees slot 0 of its own sequence, so it widens no attention."""
        T, E = max(map(len, blocks)), max(b.extra.shape[-1] for b in blocks)
        padded = []
        for b in blocks:
            if len(b) < T:
                z = torch.zeros(1, T - len(b), dtype=torch.long)
                b = Block.cat(b, Block(z, z, torch.full((T - len(b),), trash), z + 1, z[..., None] - 1))
            extra = F.pad(b.extra, (0, E - b.extra.shape[-1]), value=-1)
            padded.append(Block(b.tokens, b.pos, b.slots[None], b.committed, extra))
        return Block(*(torch.cat([getattr(b, f.name) for b in padded]) for f in fields(Block)))

    def pad(self, Q: int, trash: int, E: int) -> "Block":
        """Pad to exactly Q rows, each row's visible slots to E (-1: none); padding rows write and read only the
        trash slot."""
        n = len(self)
        assert n <= Q, f"block of {n} rows exceeds Q={Q}"
        B, device = self.tokens.shape[0], self.slots.device
        z = torch.zeros(B, Q - n, dtype=torch.long, device=device)
        slots = torch.full((*self.slots.shape[:-1], Q - n), trash, device=device)
        filler = Block(z, z, slots, z, (z + trash)[..., None])
        b = Block.cat(self, filler)
        b.extra = F.pad(b.extra, (0, E - b.extra.shape[-1]), value=-1)
        return b

    def to(self, device) -> "Block":
        return Block(*(getattr(self, f.name).to(device) for f in fields(self)))


def packed(tensors) -> tuple[torch.Tensor, tuple]:
    """A program's host integer tensors (None: none given) as one, copied to the device at once, and their shapes."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors if t is not None])
    return flat, tuple(None if t is None else tuple(t.shape) for t in tensors)


def unpacked(flat: torch.Tensor, shapes: tuple) -> list:
    """packed's tensors again, as views of flat (inside a program: no copy), and None where none was given."""
    parts = iter(flat.split([math.prod(s) for s in shapes if s is not None]))
    return [None if s is None else next(parts).view(s) for s in shapes]
