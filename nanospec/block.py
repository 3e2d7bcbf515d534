"""A Block: the rows of one forward, each with its position, its cache slot and the slots it sees.

The model (model.py) computes a block; the trees (tree.py) and the engine lay blocks out, on the host, and the
engine stacks a batch's sequences' blocks into one (each sequence its own cache row). Exact mode pads a block to
a fixed shape (Block.pad), so that its forward's shapes are the same every step.
"""
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class Block:
    """T rows of one forward for each of B sequences (a batch: each sequence its own cache row)."""
    tokens: torch.Tensor  # (B, T) token ids (ignored for rows fed as embeddings)
    pos: torch.Tensor     # (B, T) RoPE positions
    slots: torch.Tensor   # (T,) or per sequence (B, T): the cache slot each row writes its key/value to
    prefix: torch.Tensor  # (B, T) each row sees committed slots 0..prefix-1 ...
    extra: torch.Tensor   # (B, T, E) ... then these slots, in this order (-1 = none)

    def __len__(self):
        return self.slots.shape[-1]

    @staticmethod
    def cat(*blocks: "Block") -> "Block":
        E = max(b.extra.shape[-1] for b in blocks)
        cat = lambda f, dim=1: torch.cat([getattr(b, f) for b in blocks], dim)
        extra = torch.cat([F.pad(b.extra, (0, E - b.extra.shape[-1]), value=-1) for b in blocks], 1)
        return Block(cat("tokens"), cat("pos"), cat("slots", -1), cat("prefix"), extra)

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
            padded.append(Block(b.tokens, b.pos, b.slots[None], b.prefix, extra))
        return Block(*(torch.cat([getattr(b, f.name) for b in padded]) for f in fields(Block)))

    def pad(self, Q: int, trash: int) -> "Block":
        """Pad to exactly Q rows; padding rows write and read only the trash slot."""
        n = len(self)
        assert n <= Q, f"block of {n} rows exceeds Q={Q}"
        B, dev = self.tokens.shape[0], self.slots.device
        z = torch.zeros(B, Q - n, dtype=torch.long, device=dev)
        filler = Block(z, z, torch.full((*self.slots.shape[:-1], Q - n), trash, device=dev), z, (z + trash)[..., None])
        return Block.cat(self, filler)

    def to(self, device) -> "Block":
        return Block(*(getattr(self, f.name).to(device) for f in fields(self)))
