"""A Llama that computes a block of rows with explicit positions, cache slots and visibility.

Every forward takes a Block (cache.py): T rows, each with a RoPE position, the KVCache slot its key/value is written
to, and the slots it may attend to: "the committed prefix 0..prefix-1, then `extra` in the given order" -- for a tree
node, its ancestors by depth and itself: the canonical key order (README, "The contract"), in which each row reduces
over its visible keys as AR would see them. A batch's sequences each have their own cache row (a forward's seqs).
Two modes:
- exact: each row reduces over its visible keys in canonical order, the keys before its last W read in place and
  the last W gathered (exact.py says why), at fixed shapes, so its result depends only on its own input and visible
  keys: in a fixed block of Q rows per sequence, a node's logits are bitwise AR's.
- fast: SDPA over the used part of the cache with a boolean mask, and each product in the device's form
  (devices.Device.kernels: a tuned one, tuning/products.py, else F.linear).
The families beside Llama are data in ModelArgs: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's sliding
window. The window is visibility, in both modes (Llama.context): a row at position p sees keys at positions
> p - window, as transformers does. Committed slot j holds position j, a slot the block writes its row's position
(trees of any depth); slots of a method's own keys (BiTA's prompt) hold none and stay visible.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import devices
from .cache import Block
from .devices import Device
from .exact import Canonical, canonical
from .exact import attend as attend_exact
from .fused import fuse
from .rope import KINDS, inv_freq

# Fast mode's SDPA backends, explicit: left to choose, PyTorch may pick cuDNN, which replans per key length.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads (MHA)
    vocab_size: int = 4096
    hidden_dim: int = 688  # SwiGLU inner size
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    bos_id: int | None = 1
    eos_id: int | None = 2
    pad_id: int | None = None
    qkv_bias: bool = False  # Qwen2: q, k and v projections with biases
    qk_norm: bool = False  # Qwen3: an RMSNorm on each head of q and of k, before RoPE
    sliding_window: int | None = None  # Mistral: a row at position p sees keys at positions > p - window

    def __post_init__(self):
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")
        if self.hd % 2:
            raise ValueError(f"head_dim={self.hd} must be even for RoPE")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in KINDS:
            raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


@dataclass
class Context:
    """Per-forward attention inputs derived once from a Block and shared by all layers."""
    cos: torch.Tensor
    sin: torch.Tensor                  # signed: -sin on the first half of a head (see apply_rope)
    slots: torch.Tensor                # (T,) or per sequence (B, T): the cache slot each row writes
    exact: bool
    cache_rows: torch.Tensor | None = None  # (B, 1, 1, 1) each sequence's cache row: where its rows write and read
    seqs: torch.Tensor | None = None   # (B,) the same, or None: the cache's rows in order
    order: Canonical | None = None     # exact: each row's keys in canonical order (exact.py)
    mask: torch.Tensor | None = None   # fast: (B, T, L) visible slots; None = all of 0..L-1
    L: int = 0                         # fast: number of cache slots in use
    delta: object = None               # delta(layer, x, y): a product's update on some rows (SDSAT's adaptive rows)
    dev: Device = Device()             # the device's layout and speed (devices.py): every device need goes through it

    def layer(self, layer, x, kv):
        """A layer over the rows: in exact mode through the device's callable for it, if any (a compiled layer)."""
        call = self.dev.call if self.exact else None
        return layer(x, self, kv) if call is None else call(layer, x, self, kv)

    def linear(self, layer, x, add=None):
        """A layer's product (with its bias, if any), plus add (a residual) if given. Exact mode: the rows as the
        device's products need them (devices.Device.aligned), in one kernel over the rows folded into one matrix,
        F.linear, or addmm with add in its epilogue (AR's kernel). Fast mode: the device's form of the product
        (devices.Device.kernels: a tuned one, else F.linear)."""
        if not self.exact:
            y = F.linear(x, layer.weight, layer.bias) if self.dev.kernels is None else self.dev.kernels(layer, x)
        elif add is None:
            x = self.dev.aligned(x)
            y = F.linear(x.flatten(0, -2), layer.weight, layer.bias).view(*x.shape[:-1], -1)
        else:
            x = self.dev.aligned(x)
            y = torch.addmm(add.flatten(0, -2), x.flatten(0, -2), layer.weight.t()).view(add.shape)
        y = y if self.delta is None else self.delta(layer, x, y)
        return y + add if add is not None and not self.exact else y

    def elementwise(self, fn, x):
        """fn(x); in exact mode each row's result independent of its index (devices.Device.elementwise)."""
        return self.dev.elementwise(fn, x) if self.exact else fn(x)

    def select(self, rows: torch.Tensor) -> "Context":
        """The context of a subset of rows (e.g. survivors of pruning), sliced rather than rebuilt."""
        pick = lambda t: None if t is None else t[:, rows]
        return Context(pick(self.cos), pick(self.sin), self.slots[..., rows], self.exact, self.cache_rows,
                       self.seqs, mask=pick(self.mask), L=self.L, dev=self.dev)  # fast mode only

    def write(self, kv, k, v):
        """Store the rows' keys and values (B, T, Hkv, D) in their sequences' cache rows of kv (2, B, Hkv, S, D'),
        both in one copy; returns kv."""
        new, c = torch.stack((k, v)), kv[..., :k.shape[-1]]  # (2, B, T, Hkv, D); a cache's head width may be padded
        if self.seqs is None and self.slots.dim() == 1:  # one row of slots for the batch: the faster copy
            c.index_copy_(3, self.slots, new.transpose(2, 3))
        else:
            c[:, self.cache_rows.view(-1, 1), :, self.slots] = new.permute(1, 2, 0, 3, 4)  # (B, T, 2, Hkv, D)
        return kv


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, weight=None):  # weight: in place of its own (Attention: q's and k's at once)
        xf, w = x.float(), self.weight if weight is None else weight
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def apply_rope(x, cos, sin):
    """x (B, T, ..., D) rotated (q and k: a key head's query heads, then its key); cos, sin (B, T, 1, 1, D), sin signed
    (-sin, sin): HF's x * cos + cat(-x2, x1) * sin bit for bit (a negation is exact), in four ops."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def attend_fast(q, kv, ctx):
    """SDPA over cache slots 0..L-1; query heads folded into rows so GQA needs no key copy."""
    B, T, Hkv, G, D = q.shape
    seqs = slice(None) if ctx.seqs is None else ctx.seqs
    k, v = kv[:, seqs, :, :ctx.L, :D]  # (B, Hkv, L, D) each: a cache's head width may be padded
    q = q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    mask = ctx.mask
    if mask is not None:
        mask = mask[:, None, None].expand(B, 1, G, T, ctx.L).reshape(B, 1, G * T, ctx.L)
    with sdpa_kernel(SDPA_BACKENDS):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, Hkv, G*T, D)
    return y.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G * D)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads, args.hd
        H, Hkv = args.n_heads * args.hd, args.kv_heads * args.hd
        # per key head: its G query heads, its key, its value (q and k then rotate at once)
        fuse(self, "qkv", args.dim, {"q_proj": H, "k_proj": Hkv, "v_proj": Hkv}, args.kv_heads, args.qkv_bias)
        self.q_norm, self.k_norm = (RMSNorm(args.hd, args.norm_eps) for _ in "qk") if args.qk_norm else (None, None)
        self.o_proj = nn.Linear(H, args.dim, bias=False)
        self.o_proj.role = "o_proj"

    def forward(self, x, ctx: Context, kv, residual):
        B, T, _ = x.shape
        G = self.n_heads // self.n_kv
        qkv = ctx.linear(self.qkv, x).view(B, T, self.n_kv, G + 2, self.hd)  # per key head: G queries, key, value
        qk, v = qkv[:, :, :, :G + 1], qkv[:, :, :, G + 1]
        if self.q_norm is not None:  # each head of q and of k normed by its own weight, before RoPE
            qk = self.q_norm(qk, torch.cat((self.q_norm.weight.expand(G, -1), self.k_norm.weight[None])))
        qk = apply_rope(qk, ctx.cos, ctx.sin)
        q, k = qk[:, :, :, :G], qk[:, :, :, G]
        kv = torch.stack((k, v)).transpose(2, 3) if kv is None else ctx.write(kv, k, v)  # None: keys at rows 0..T-1
        y = (attend_exact if ctx.exact else attend_fast)(q, kv, ctx)
        return ctx.linear(self.o_proj, y, residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        fuse(self, "gate_up", args.dim, {"gate_proj": args.hidden_dim, "up_proj": args.hidden_dim})
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.down_proj.role = "down_proj"

    def forward(self, x, ctx: Context, residual):
        gate, up = ctx.linear(self.gate_up, x).chunk(2, dim=-1)
        return ctx.linear(self.down_proj, ctx.elementwise(F.silu, gate) * up, residual)


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, ctx, kv):
        x = self.attn(self.attn_norm(x), ctx, kv, residual=x)
        return self.mlp(self.mlp_norm(x), ctx, residual=x)


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_rope()

    def init_rope(self, device=None):
        """RoPE's constants in fp32, whatever the weights: both halves' frequencies, and sin's signs."""
        a = self.args
        inv = inv_freq(a.hd, a.rope_theta, a.rope_scaling).to(device)
        self.register_buffer("freqs", torch.cat((inv, inv)), persistent=False)
        self.register_buffer("signs", torch.cat((-torch.ones_like(inv), torch.ones_like(inv))), persistent=False)

    def _apply(self, fn, *args, **kwargs):  # model.to(dtype, device): the RoPE constants move, and stay fp32
        super()._apply(fn, *args, **kwargs)
        self.init_rope(self.embed.weight.device)
        return self

    def rope(self, pos: torch.Tensor, dev: Device | None = None):
        """cos and signed sin (B, T, 1, 1, D) for positions (B, T) (see apply_rope); dev: exact mode's device."""
        freqs, dt = pos[..., None, None, None] * self.freqs, self.embed.weight.dtype  # fp32 like HF (int * float)
        f = dev.elementwise if dev else lambda fn, x: fn(x)
        return f(torch.cos, freqs).to(dt), (f(torch.sin, freqs) * self.signs).to(dt)

    def context(self, block: Block, n_slots: int, exact: bool, seqs=None, tail: int = 1, dev=None,
                ids=None) -> Context:
        """The block's attention inputs. n_slots: the cache's (its physical slots); tail: in exact mode the keys each
        row gathers in canonical order (at least the deepest row's ancestors and itself; the rest it reads in place);
        dev: the device's layout and speed (default: devices.of the block's device); ids: 0, 1, ... on the device,
        at least n_slots + 1 and the batch of them (KVCache.ids: made once, a program's indices are its views)."""
        dev = devices.of(block.extra.device) if dev is None else dev
        W = tail - tail % -dev.slot_grain  # whole rows of the device's grain
        n = max(n_slots + 1, W, len(block.extra), block.extra.shape[-1] + 1, self.args.kv_heads)
        ids = torch.arange(n, device=block.extra.device) if ids is None or len(ids) < n else ids
        rows = (ids[:len(block.extra)] if seqs is None else seqs)[:, None, None, None]
        ctx = Context(*self.rope(block.pos, dev if exact else None), block.slots, exact, rows, seqs, dev=dev)
        prefix, extra, win = block.prefix[..., None], block.extra, self.args.sliding_window
        gone = None if win is None else block.pos[..., None] - win  # keys at positions <= gone: out of the window
        if gone is not None:
            pos = torch.full((len(extra), n_slots), 1 << 62, device=extra.device)  # each slot's position
            pos = pos.scatter_(1, block.slots.expand(len(extra), -1), block.pos)
            extra = extra.masked_fill(pos.gather(1, extra.clamp(min=0).flatten(1)).view_as(extra) <= gone, -1)
        if exact:
            a, dt = self.args, self.embed.weight.dtype
            ctx.order = canonical(prefix, extra, gone, n_slots, W, a.kv_heads, a.n_heads // a.kv_heads, ids, dt)
            return ctx
        ctx.L = L = max(int(block.prefix.max()), int(extra.max()) + 1)  # fast: SDPA over slots 0..L-1, masked
        # scatter the extra slots into a (B, T, L+1) mask; column L collects the -1 padding
        j = torch.arange(L + 1, device=extra.device)
        mask = j < prefix
        if gone is not None:
            mask &= j > gone
        mask = mask.scatter_(-1, torch.where(extra < 0, L, extra), True)[..., :L]
        ctx.mask = None if bool(mask.all()) else mask
        return ctx

    def forward(self, block: Block, cache=None, exact: bool = False, tail: int = 1, dev=None):
        """Logits (B, T, V) for the block's rows. cache=None (training): row t's key is slot t, so the
        block's slots must be 0..T-1 and visibility refers to rows (training.loop.causal: a plain LM block)."""
        f = Forward.on_cache(self, block, cache, exact, tail=tail, dev=dev) if cache else \
            Forward(self, block, self.context(block, len(block), exact, tail=tail, dev=dev), [None] * len(self.layers))
        return f.logits(f.norm(f.layers(f.embed())), len(block))


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
    def on_cache(cls, model: Llama, block: Block, cache, exact: bool, seqs=None, tail: int = 1, dev=None):
        """seqs (B,): the cache rows of the block's sequences (None: the cache's rows in order); tail: exact mode's
        keys gathered per row (sizes.shapes' W); dev: the device's layout and speed (devices.py)."""
        return cls(model, block, model.context(block, cache.kv.shape[-2], exact, seqs, tail, dev, cache.ids), cache.kv)

    @classmethod
    def training(cls, model: Llama, tokens, pos, vis, prefix=None) -> "Forward":
        """A cache-free forward over rows that see each other as vis (B, R, K + R) says, K being the keys and values
        that prefix[i] or prefix(i) puts before the rows in layer i (SDSAT's frozen standard rows, BiTA's deep
        prompt)."""
        (B, R), a, w = tokens.shape, model.args, model.embed.weight
        K = vis.shape[-1] - R
        ctx = Context(*model.rope(pos), torch.arange(K, K + R, device=tokens.device), False, mask=vis, L=K + R)
        blk = Block(tokens, pos, ctx.slots, torch.zeros_like(pos), torch.full((B, R, 1), -1, device=tokens.device))
        own = lambda i: w.new_zeros(2, B, a.kv_heads, R, a.hd)
        before = lambda i: (prefix(i) if callable(prefix) else prefix[i]).expand(-1, B, -1, -1, -1)  # (2, B, Hkv, K, D)
        kv = [own(i) if prefix is None else torch.cat([before(i), own(i)], 3) for i in range(a.n_layers)]
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
