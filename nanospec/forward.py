"""How a forward runs: the one object through which the plain model (model.py) reaches a device, a speed path and a
method's hooks (Context), and a pass over a block of rows as a method's step is written against it (Forward).

A forward's rows come as a Block (cache.py): T rows, each with a RoPE position, the KVCache slot its key and value are
written to, and the slots it may attend to: the committed slots 0..committed-1, then `extra` in the given order (for a
tree node, its ancestors by depth and itself: the canonical key order, exact.py). `context` turns a Block into a
Context once; every layer shares it. Two modes:
- exact: each row reduces over its visible keys in canonical order at fixed shapes (exact.py says why), each product's
  rows laid out as the device needs (devices.Device.aligned), each elementwise kernel row-independent
  (devices.Device.elementwise), each residual added in its product's kernel (exact_layer), a layer compiled if the
  device's `call` says so (compiled.py): in a fixed block of Q rows per sequence, a node's logits are bitwise AR's.
- fast: SDPA over the used part of the cache with a boolean mask, each product in the device's form
  (devices.Device.forms: a tuned one, tuning/products.py, else F.linear), and the layers as model.py writes them.
Mistral's window is visibility, in both modes: a row at position p sees keys at positions > p - window, as transformers
does. Committed slot j holds position j, a slot the block writes its row's position (trees of any depth); slots of a
method's own keys (BiTA's prompt) hold none and stay visible.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import devices
from .cache import Block
from .devices import Device
from .exact import Canonical, canonical
from .exact import attend as attend_exact
from .model import Llama

# Fast mode's SDPA backends, explicit: left to choose, PyTorch may pick cuDNN, which replans per key length.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Context:
    """A forward's rows as the model's modules see them (`ctx` in model.py): what is per row, and the device's and a
    method's form of each step the model takes."""
    cos: torch.Tensor
    sin: torch.Tensor                  # signed: -sin on the first half of a head (model.apply_rope)
    slots: torch.Tensor                # (T,) or per sequence (B, T): the cache slot each row writes
    exact: bool
    cache_rows: torch.Tensor | None = None   # (B,) each sequence's cache row, or None: the cache's rows in order
    cache_index: torch.Tensor | None = None  # (B, 1, 1, 1) cache_rows (0..B-1 for None) as an index into kv
    canonical: Canonical | None = None  # exact: each row's keys in canonical order (exact.py)
    mask: torch.Tensor | None = None   # fast: (B, T, L) visible slots; None = all of 0..L-1
    L: int = 0                         # fast: number of cache slots in use
    delta: object = None               # delta(proj, x, y): a product's update on some rows (SDSAT's adaptive rows)
    dev: Device = Device()             # the device's layout and speed (devices.py)

    def layer(self, layer, x, kv):
        """A layer over the rows: fast mode's as model.Layer writes it; exact mode's through the device's callable
        for it (a compiled layer), else exact_layer."""
        if not self.exact:
            return layer(x, self, kv)
        return (self.dev.call or exact_layer)(layer, x, self, kv)

    def linear(self, proj, x, add=None):
        """proj(x), a layer's product (with its bias, if any). Exact mode: the rows as the device's products need
        them (devices.Device.aligned), folded into one matrix: F.linear, or addmm with add (a residual) in its
        epilogue (o_proj and down_proj, which have no bias in any family). Fast mode: the device's form of the
        product (devices.Device.forms: a tuned one, else F.linear)."""
        if not self.exact:
            y = F.linear(x, proj.weight, proj.bias) if self.dev.forms is None else self.dev.forms(proj, x)
        else:
            x = self.dev.aligned(x)
            rows = x.flatten(0, -2)
            y = F.linear(rows, proj.weight, proj.bias) if add is None else \
                torch.addmm(add.flatten(0, -2), rows, proj.weight.t())
            y = y.view(*x.shape[:-1], -1)
        return y if self.delta is None else self.delta(proj, x, y)

    def elementwise(self, fn, x):
        """fn(x); in exact mode each row's result independent of its index (devices.Device.elementwise)."""
        return self.dev.elementwise(fn, x) if self.exact else fn(x)

    def write(self, kv, k, v):
        """The rows' keys and values (B, T, Hkv, D) stored in their sequences' cache rows of kv (2, B, Hkv, S, D'),
        both in one copy; returns kv. kv None (a cache-free forward): the rows' own, row t at slot t."""
        new = torch.stack((k, v))  # (2, B, T, Hkv, D)
        if kv is None:
            return new.transpose(2, 3)
        c = kv[..., :k.shape[-1]]  # a cache's head width may be padded
        if self.cache_rows is None and self.slots.dim() == 1:  # one row of slots for the batch: the faster copy
            c.index_copy_(3, self.slots, new.transpose(2, 3))
        else:
            c[:, self.cache_index.view(-1, 1), :, self.slots] = new.permute(1, 2, 0, 3, 4)  # (B, T, 2, Hkv, D)
        return kv

    def attend(self, q, kv):
        """q (B, T, Hkv, G, D) over kv's keys and values: exact mode's canonical order (exact.attend), or SDPA."""
        return attend_exact(q, kv, self) if self.exact else attend_fast(q, kv, self)

    def select(self, rows: torch.Tensor) -> "Context":
        """The context of a subset of rows (e.g. survivors of pruning), sliced rather than rebuilt (fast mode)."""
        pick = lambda t: None if t is None else t[:, rows]
        return Context(pick(self.cos), pick(self.sin), self.slots[..., rows], self.exact, self.cache_rows,
                       self.cache_index, mask=pick(self.mask), L=self.L, dev=self.dev)


def exact_layer(layer, x, ctx: Context, kv):
    """model.Layer.forward as exact mode runs it: each residual added in its product's kernel (addmm's epilogue),
    one kernel where `x + ...` is two."""
    x = ctx.linear(layer.attn.o_proj, layer.attn.attention(layer.attn_norm(x), ctx, kv), add=x)
    return ctx.linear(layer.mlp.down_proj, layer.mlp.inner(layer.mlp_norm(x), ctx), add=x)


def attend_fast(q, kv, ctx: Context):
    """SDPA over cache slots 0..L-1; query heads folded into rows so GQA needs no key copy."""
    B, T, Hkv, G, D = q.shape
    cache_rows = slice(None) if ctx.cache_rows is None else ctx.cache_rows
    k, v = kv[:, cache_rows, :, :ctx.L, :D]  # (B, Hkv, L, D) each: a cache's head width may be padded
    q = q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    mask = ctx.mask
    if mask is not None:
        mask = mask[:, None, None].expand(B, 1, G, T, ctx.L).reshape(B, 1, G * T, ctx.L)
    with sdpa_kernel(SDPA_BACKENDS):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, Hkv, G*T, D)
    return y.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G * D)


def angles(model: Llama, pos: torch.Tensor, dev: Device | None = None):
    """RoPE's cos and signed sin (B, T, 1, D) for positions (B, T) (model.apply_rope), computed in fp32 as HF does
    and rounded to the weights' dtype; dev: exact mode's device (its elementwise kernels)."""
    freqs, signs = model.rope_constants()
    freqs = pos[..., None, None] * freqs  # int * fp32: fp32
    f, dt = dev.elementwise if dev else lambda fn, x: fn(x), model.embed.weight.dtype
    return f(torch.cos, freqs).to(dt), (f(torch.sin, freqs) * signs).to(dt)


def context(model: Llama, block: Block, n_slots: int, exact: bool, cache_rows=None, tail: int = 1,
            dev=None, arange=None) -> Context:
    """The block's Context. n_slots: the cache's (its physical slots); tail: in exact mode the keys each row gathers in
    canonical order (at least the deepest row's ancestors and itself, rounded up to a multiple of the device's
    slot_grain; the rest it reads in place); dev: the device's layout and speed (default: devices.of the block's
    device); arange: 0, 1, ... on the device, at least n_slots + 1 and the batch of them (KVCache.arange: made once, a
    program's indices are its views)."""
    dev = devices.of(block.extra.device) if dev is None else dev
    W = tail - tail % -dev.slot_grain  # a count of keys, rounded up to a multiple of the device's slot grain
    n = max(n_slots + 1, W, len(block.extra), block.extra.shape[-1] + 1, model.args.kv_heads)
    arange = torch.arange(n, device=block.extra.device) if arange is None or len(arange) < n else arange
    index = (arange[:len(block.extra)] if cache_rows is None else cache_rows)[:, None, None, None]
    ctx = Context(*angles(model, block.pos, dev if exact else None), block.slots, exact, cache_rows, index, dev=dev)
    committed, extra, win = block.committed[..., None], block.extra, model.args.sliding_window
    gone = None if win is None else block.pos[..., None] - win  # keys at positions <= gone: out of the window
    if gone is not None:
        pos = torch.full((len(extra), n_slots), 1 << 62, device=extra.device)  # each slot's position
        pos = pos.scatter_(1, block.slots.expand(len(extra), -1), block.pos)
        extra = extra.masked_fill(pos.gather(1, extra.clamp(min=0).flatten(1)).view_as(extra) <= gone, -1)
    if exact:
        a, dt = model.args, model.embed.weight.dtype
        ctx.canonical = canonical(committed, extra, gone, n_slots, W, a.kv_heads, a.n_heads // a.kv_heads, arange, dt)
        return ctx
    ctx.L = L = max(int(block.committed.max()), int(extra.max()) + 1)  # fast: SDPA over slots 0..L-1, masked
    # scatter the extra slots into a (B, T, L+1) mask; column L collects the -1 padding
    j = torch.arange(L + 1, device=extra.device)
    mask = j < committed
    if gone is not None:
        mask &= j > gone
    mask = mask.scatter_(-1, torch.where(extra < 0, L, extra), True)[..., :L]
    ctx.mask = None if bool(mask.all()) else mask
    return ctx


def run(model: Llama, block: Block, cache=None, exact: bool = False, tail: int = 1, dev=None) -> torch.Tensor:
    """Logits (B, T, V) for the block's rows. cache=None (training): row t's key is slot t, so the block's slots must
    be 0..T-1 and visibility refers to rows (training.loop.causal: a plain LM block)."""
    f = Forward.on_cache(model, block, cache, exact, tail=tail, dev=dev) if cache else \
        Forward(model, block, context(model, block, len(block), exact, tail=tail, dev=dev), [None] * len(model.layers))
    return model(block.tokens, f.ctx, f.kv)


class Forward:
    """One forward pass over a block of rows, as a method's step is written against it: embed, run layers (all rows,
    or only the `active` ones: ProPD's survivors of pruning, Hidden Transfer's real rows before its pseudo rows
    join), norm, logits. Fast mode runs only active rows (removed, then put back); exact mode runs every row of its
    fixed-shape block, since a row's result never depends on the other rows, and so the whole step can be one CUDA
    graph. Training forwards use it over a cache-free, masked context (`training`), so a method's trainer and its
    decoder share one layer loop."""

    def __init__(self, model: Llama, block: Block, ctx: Context, kv):
        """kv[i]: layer i's keys and values (the KV cache's, a training forward's own, None: the rows' own)."""
        self.model, self.block, self.ctx, self.kv, self.exact = model, block, ctx, kv, ctx.exact

    @classmethod
    def on_cache(cls, model: Llama, block: Block, cache, exact: bool, cache_rows=None, tail: int = 1, dev=None):
        """cache_rows (B,): each sequence's cache row, its index in the cache's batch (None: the cache's rows in
        order); tail: exact mode's keys gathered per row (sizes.shapes' W); dev: the device's layout and speed
        (devices.py)."""
        ctx = context(model, block, cache.kv.shape[-2], exact, cache_rows, tail, dev, cache.arange)
        return cls(model, block, ctx, cache.kv)

    @classmethod
    def training(cls, model: Llama, tokens, pos, vis, before=None) -> "Forward":
        """A cache-free forward over rows that see each other as vis (B, R, K + R) says, K being the keys and values
        that before[i] or before(i) puts ahead of the rows in layer i (SDSAT's frozen standard rows, BiTA's deep
        prompt)."""
        (B, R), a, w = tokens.shape, model.args, model.embed.weight
        K = vis.shape[-1] - R
        ctx = Context(*angles(model, pos), torch.arange(K, K + R, device=tokens.device), False, mask=vis, L=K + R)
        blk = Block(tokens, pos, ctx.slots, torch.zeros_like(pos), torch.full((B, R, 1), -1, device=tokens.device))
        own = lambda i: w.new_zeros(2, B, a.kv_heads, R, a.hd)
        given = lambda i: (before(i) if callable(before) else before[i]).expand(-1, B, -1, -1, -1)  # (2, B, Hkv, K, D)
        kv = [own(i) if before is None else torch.cat([given(i), own(i)], 3) for i in range(a.n_layers)]
        return cls(model, blk, ctx, kv)

    def embed(self) -> torch.Tensor:
        return self.model.embed(self.block.tokens)

    def layers(self, x, start: int = 0, stop: int | None = None, active=None, delta=None) -> torch.Tensor:
        """x after layers start..stop-1. active (R,) or per sequence (B, R) bool: the rows that need them; fast mode
        runs only those (in a batch, the rows some sequence needs; the others keep x), exact mode runs all rows
        (inactive ones are never read). delta: per layer, an update of its products on some rows (Context.delta:
        SDSAT's adaptive rows), for a whole block (no active)."""
        layers = range(start, len(self.model.layers) if stop is None else stop)
        ctx, rows = self.ctx, None
        active = active.any(0) if active is not None and active.dim() == 2 else active
        if active is not None and not self.exact and not bool(active.all()):
            rows = active.nonzero()[:, 0]
            ctx, y = ctx.select(rows), x[:, rows]
        else:
            y = x
        for i in layers:
            c = ctx if delta is None else replace(ctx, delta=delta[i])
            y = c.layer(self.model.layers[i], y, self.kv[i])
        return y if rows is None else x.index_copy(1, rows, y)

    def norm(self, x) -> torch.Tensor:
        return self.model.norm(x)

    def logits(self, h, n: int) -> torch.Tensor:
        """The first n rows' logits (B, n, V). Exact mode multiplies every row, as AR's block does (a GEMM's rows
        depend on its shape); fast mode only the n asked for."""
        return self.ctx.linear(self.model.lm_head, h if self.exact else h[:, :n])[:, :n]
