"""One forward pass over a block of rows, as a method's verification forward sees it.

A method writes the paper's step against a Forward: embed, run layers (all rows, or only the
`active` ones: ProPD's survivors of pruning, Hidden Transfer's real rows before its pseudo rows
join), norm, logits. The core decides how: fast mode runs only active rows (removed, then put
back); exact mode runs every row of its fixed-shape block, since a row's result never depends
on the other rows, and so the whole step can be one CUDA graph. Training forwards use the same
object over a cache-free, masked context (`Forward.training`), so a method's trainer and its
decoder share one layer loop.
"""
from dataclasses import dataclass

import torch

from .model import Block, Context


class Forward:
    def __init__(self, model, block: Block, ctx: Context, kv):
        """kv(i): layer i's key/value buffers (the KV cache's, or a training forward's own)."""
        self.model, self.block, self.ctx, self.kv = model, block, ctx, kv
        self.exact = ctx.exact

    @classmethod
    def on_cache(cls, model, block: Block, cache, exact: bool) -> "Forward":
        return cls(model, block, model.context(block, cache.n_slots, exact), cache.layer)

    @classmethod
    def training(cls, model, tokens, pos, vis, prefix=None) -> "Forward":
        """A cache-free forward over rows that see each other as vis (B, R, K + R) says, K being
        the keys that `prefix(i)` puts before the rows in layer i (BiTA's deep prompt)."""
        (B, R), a = tokens.shape, model.args
        K = vis.shape[-1] - R
        ctx = Context(*model.rope(pos), torch.arange(K, K + R, device=tokens.device), False, mask=vis, L=K + R)
        blk = Block(tokens, pos, ctx.slots, torch.zeros_like(pos), torch.full((B, R, 1), -1, device=tokens.device))
        w = model.embed.weight

        def kv(i):
            k, v = (w.new_zeros(B, a.kv_heads, R, a.hd) for _ in range(2))
            if prefix is None:
                return k, v
            pk, pv = prefix(i)
            return torch.cat([pk.expand(B, -1, -1, -1), k], 2), torch.cat([pv.expand(B, -1, -1, -1), v], 2)
        return cls(model, blk, ctx, kv)

    def embed(self) -> torch.Tensor:
        return self.model.embed(self.block.tokens)

    def layers(self, x, start: int = 0, stop: int | None = None, active=None) -> torch.Tensor:
        """x after layers start..stop-1. active (R,) bool: the rows that need them; fast mode runs
        only those (the others keep x), exact mode runs all rows (inactive ones are never read)."""
        layers = range(start, len(self.model.layers) if stop is None else stop)
        ctx, rows = self.ctx, None
        if active is not None and not self.exact and not bool(active.all()):
            rows = active.nonzero()[:, 0]
            ctx, y = ctx.select(rows), x[:, rows]
        else:
            y = x
        for i in layers:
            y = self.model.layers[i](y, ctx, *self.kv(i))
        return y if rows is None else x.index_copy(1, rows, y)

    def norm(self, x) -> torch.Tensor:
        return self.model.norm(x)

    def logits(self, h, n: int) -> torch.Tensor:
        """The first n rows' logits (n, V). Exact mode multiplies every row, as AR's block does (a
        GEMM's rows depend on its shape); fast mode only the n asked for."""
        if self.exact:
            return self.model.lm_head(self.ctx.rows(h))[0, :n]
        return self.ctx.mm(self.model.lm_head, h[0, :n])


@dataclass
class Out:
    """What a method's verification forward computed, per tree node (tree rows come first)."""
    logits: torch.Tensor                 # (N, V): each node's logits, verified against AR
    drafts: torch.Tensor | None = None   # (N, K', D): per node, what drafts the next tree if it ends the
    #                                      accepted path (hidden states); Drafter.propose makes (K, V) of them
    depths: torch.Tensor | None = None   # (N,): how many of the K draft depths are real (None: all; 0: none)
    alive: torch.Tensor | None = None    # (N,) bool: the nodes left to verify (ProPD prunes the rest)
