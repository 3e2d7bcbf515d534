"""A Llama that computes a block of rows with explicit positions, cache slots and visibility.

Every forward takes a Block (cache.py): T rows, each with a RoPE position, the KVCache slot its key/value is written
to, and the slots it may attend to: "the committed prefix 0..prefix-1, then `extra` in the given order" -- for a tree
node, its ancestors by depth and itself: the canonical key order (README, "The contract"), in which each row reduces
over its visible keys as AR would see them. A batch's sequences each have their own cache row (a forward's seqs).
Two modes:
- exact: each row reduces over its visible keys in canonical order, the keys before its last W read in place and
  the last W gathered (attend_exact), at fixed shapes, so its result depends only on its own input and visible
  keys: in a fixed block of Q rows per sequence, a node's logits are bitwise AR's.
- fast: SDPA over the used part of the cache with a boolean mask, and each product in the device's form
  (devices.Device.kernels: a tuned one, tuning/products.py, else F.linear).
The families beside Llama are data in ModelArgs: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's sliding
window. The window is visibility, in both modes (Llama.context): a row at position p sees keys at positions
> p - window, as transformers does. Committed slot j holds position j, a slot the block writes its row's position
(trees of any depth); slots of a method's own keys (BiTA's prompt) hold none and stay visible.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import devices
from .cache import Block
from .devices import Device
from .fused import fuse
from .rope import KINDS, inv_freq

NEUTRAL = Device()  # a device that needs nothing of exact mode's rows (a GPU's view: devices.py)

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
    slots: torch.Tensor
    exact: bool
    tail: torch.Tensor | None = None   # exact: (B, 1, T, W) the slots of each row's last W keys, canonical order
    bias: tuple | None = None          # exact: the scores' masks (0 visible, -inf not): in place, then the tail
    b: torch.Tensor | None = None      # (B, 1, 1, 1) the cache rows (the writes' index), and in exact mode
    h: torch.Tensor | None = None      # (Hkv, 1, 1) the key heads: with b, the tail's gather indices
    mask: torch.Tensor | None = None   # fast: (B, T, L) visible slots; None = all of 0..L-1
    L: int = 0                         # fast: number of cache slots in use
    seqs: torch.Tensor | None = None   # (B,) the cache rows of the block's sequences; None: 0..B-1
    delta: object = None               # delta(layer, x, y): a product's update on some rows (SDSAT's adaptive rows)
    dev: Device = NEUTRAL              # the device's layout and speed (devices.py), as the forward's caller chose

    def rows(self, x):
        """Matmul input: in exact mode, as the device's products need it (devices.Device.rows)."""
        return self.dev.rows(x) if self.exact else x

    def layer(self, layer, x, kv):
        """A layer over the rows: in exact mode through the device's callable for it, if any (a compiled layer)."""
        call = self.dev.call if self.exact else None
        return layer(x, self, kv) if call is None else call(layer, x, self, kv)

    def mm(self, layer, x, add=None):
        """A layer's product (with its bias, if any), plus add (a residual, bias-free layers) if given. Exact mode:
        one kernel on the rows folded into one matrix, F.linear, or addmm with add in its epilogue (AR's kernel).
        Fast mode: the device's form of the product (devices.Device.kernels: a tuned one, else F.linear)."""
        if not self.exact:
            y = F.linear(x, layer.weight, layer.bias) if self.dev.kernels is None else self.dev.kernels(layer, x)
        elif add is None:
            y = F.linear(x.flatten(0, -2), layer.weight, layer.bias).view(*x.shape[:-1], -1)
        else:
            y = torch.addmm(add.flatten(0, -2), x.flatten(0, -2), layer.weight.t()).view(add.shape)
        y = y if self.delta is None else self.delta(layer, x, y)
        return y + add if add is not None and not self.exact else y

    def map(self, fn, x):
        """An elementwise fn; in exact mode each row's result is independent of its index (devices.Device)."""
        return self.dev.elementwise(fn, x) if self.exact else fn(x)

    def select(self, rows: torch.Tensor) -> "Context":
        """The context of a subset of rows (e.g. survivors of pruning), sliced rather than rebuilt."""
        pick = lambda t: None if t is None else t[:, rows]
        return Context(pick(self.cos), pick(self.sin), self.slots[..., rows], self.exact, b=self.b,
                       mask=pick(self.mask), L=self.L, seqs=self.seqs, dev=self.dev)  # fast mode only

    def write(self, kv, new):
        """Store the rows' keys and values, new (B, T, Hkv, 2, D), in their sequences' cache rows of kv (2, B, Hkv,
        S, D'), both in one copy; returns kv."""
        b = None if self.seqs is None and self.slots.dim() == 1 else self.b.view(-1, 1)
        c = kv[..., :new.shape[-1]]  # a cache's head width may be padded
        if b is None:  # one row of slots for the batch: the faster copy
            c.index_copy_(3, self.slots, new.permute(3, 0, 2, 1, 4))
        else:
            c[:, b, :, self.slots] = new.transpose(2, 3)  # advanced indices first: (B, T, 2, Hkv, D)
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
    """x (B, T, ..., D) rotated; cos, sin (B, T, 1, G + 2, D) (a key head's query heads, its key, its value), sin
    signed (-sin, sin): HF's x * cos + cat(-x2, x1) * sin bit for bit (a negation is exact), in four ops. The
    value's angle is 0 (cos 1, sin 0): it stays itself (a negative zero may turn positive, which no sum of other
    terms sees), beside its key, so the two land in the cache in one copy."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


@torch.no_grad()  # inference only: the scores are written into one buffer (out=), which autograd does not follow
def attend_exact(q, kv, ctx):
    """q (B, T, Hkv, G, D), query head h * G + g using key head h; kv (2, B, Hkv, S, D'): keys, values (D' >= D:
    a cache's head width may be padded). Each row reduces over its keys in canonical order, split where its position
    alone says: the keys before its last W are read in place, in slot order; the last W are gathered, in canonical
    order. AR's row at the same position splits at the same key, so a tree row's scores, softmax and weighted
    sums are AR's bit for bit, and no row copies more than W keys of the cache."""
    (B, T, Hkv, G, D), (S, Dc), W = q.shape, kv.shape[-2:], ctx.tail.shape[-1]
    q = F.pad(q.transpose(1, 2), (0, Dc - D)) if Dc > D else q.transpose(1, 2).contiguous()  # (B, Hkv, T, G, D')
    kt, vt = kv[:, ctx.b, ctx.h, ctx.tail]  # (B, Hkv, T, W, D') each: the tails, canonical order
    kc, vc = kv if ctx.seqs is None else kv.index_select(1, ctx.seqs)  # a subset of the cache's rows: theirs alone
    scale, (bias_in, bias_tail), L = D ** -0.5, ctx.bias, S + W
    att = q.new_empty(B, Hkv, T, G, L)  # the scores: the keys read in place, then the tail's, scaled and masked
    torch.baddbmm(bias_in, q.view(-1, T * G, Dc), kc.view(-1, S, Dc).transpose(1, 2), alpha=scale,
                  out=att.view(-1, T * G, L)[..., :S])
    torch.baddbmm(bias_tail, q.view(-1, G, Dc), kt.view(-1, W, Dc).transpose(1, 2), alpha=scale,
                  out=att.view(-1, G, L)[..., S:])
    att = F.softmax(att, dim=-1)  # one kernel: bf16's is computed in fp32 and rounded once, as HF's upcast is
    y = torch.bmm(att[..., :S].reshape(-1, T * G, S), vc.view(-1, S, Dc))  # the keys read in place, then the tail's
    y = torch.baddbmm(y.view(-1, G, Dc), att[..., S:].reshape(-1, G, W), vt.view(-1, W, Dc))  # (B*Hkv*T, G, D')
    return y.view(B, Hkv, T, G, Dc)[..., :D].transpose(1, 2).contiguous().view(B, T, Hkv * G * D)


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
        qkv = ctx.mm(self.qkv, ctx.rows(x)).view(B, T, self.n_kv, G + 2, self.hd)  # (B, T, Hkv, G + 2, D)
        if self.q_norm is not None:  # each head of q and of k normed by its own weight, before RoPE
            w = torch.cat((self.q_norm.weight.expand(G, -1), self.k_norm.weight[None]))
            qkv = torch.cat((self.q_norm(qkv[:, :, :, :G + 1], w), qkv[:, :, :, G + 1:]), 3)
        qkv = apply_rope(qkv, ctx.cos, ctx.sin)  # the values unturned
        q, new = qkv[:, :, :, :G], qkv[:, :, :, G:]
        # no cache (training): the rows' own keys are slots 0..T-1
        kv = new.permute(3, 0, 2, 1, 4) if kv is None else ctx.write(kv, new)
        y = (attend_exact if ctx.exact else attend_fast)(q, kv, ctx)
        return ctx.mm(self.o_proj, ctx.rows(y), residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        fuse(self, "gate_up", args.dim, {"gate_proj": args.hidden_dim, "up_proj": args.hidden_dim})
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.down_proj.role = "down_proj"

    def forward(self, x, ctx: Context, residual):
        gate, up = ctx.mm(self.gate_up, ctx.rows(x)).chunk(2, dim=-1)
        return ctx.mm(self.down_proj, ctx.rows(ctx.map(F.silu, gate) * up), residual)


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
        """RoPE's constants in fp32, whatever the weights: both halves' frequencies for a key head's query heads and
        its key, 0 for its value (apply_rope), and sin's signs."""
        a, G = self.args, self.args.n_heads // self.args.kv_heads
        inv = inv_freq(a.hd, a.rope_theta, a.rope_scaling).to(device)
        both = torch.cat((inv, inv))
        self.register_buffer("freqs", torch.cat((both.expand(G + 1, -1), 0 * both[None])), persistent=False)
        self.register_buffer("signs", torch.cat((-torch.ones_like(inv), torch.ones_like(inv))), persistent=False)

    def _apply(self, fn, *args, **kwargs):  # model.to(dtype, device): the RoPE constants move, and stay fp32
        super()._apply(fn, *args, **kwargs)
        self.init_rope(self.embed.weight.device)
        return self

    def rope(self, pos: torch.Tensor, dev: Device | None = None):
        """cos and signed sin (B, T, 1, G + 2, D) for positions (B, T) (see apply_rope); dev: exact mode's device."""
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
        W = tail - tail % -dev.grain(self.embed.weight.dtype)[0]  # whole rows of the device's grain
        n = max(n_slots + 1, W, len(block.extra), block.extra.shape[-1] + 1, self.args.kv_heads)
        ids = torch.arange(n, device=block.extra.device) if ids is None or len(ids) < n else ids
        ctx = Context(*self.rope(block.pos, dev if exact else None), block.slots, exact, seqs=seqs, dev=dev)
        prefix, extra, win = block.prefix[..., None], block.extra, self.args.sliding_window
        gone = None if win is None else block.pos[..., None] - win  # keys at positions <= gone: out of the window
        if gone is not None:
            at = torch.full((len(extra), n_slots), 1 << 62, device=extra.device)  # each slot's position
            at = at.scatter_(1, block.slots.expand(len(extra), -1), block.pos)
            extra = extra.masked_fill(at.gather(1, extra.clamp(min=0).flatten(1)).view_as(extra) <= gone, -1)
        ctx.b = (ids[:len(extra)] if seqs is None else seqs)[:, None, None, None]
        if exact:
            return self.canonical(ctx, prefix, extra, gone, n_slots, W, ids)
        ctx.L = L = max(int(block.prefix.max()), int(extra.max()) + 1)  # fast: SDPA over slots 0..L-1, masked
        # scatter the extra slots into a (B, T, L+1) mask; column L collects the -1 padding
        j = torch.arange(L + 1, device=extra.device)
        mask = j < prefix
        if gone is not None:
            mask &= j > gone
        mask = mask.scatter_(-1, torch.where(extra < 0, L, extra), True)[..., :L]
        ctx.mask = None if bool(mask.all()) else mask
        return ctx

    def canonical(self, ctx: Context, prefix, extra, gone, S: int, W: int, ids) -> Context:
        """Exact mode's attention inputs: each row's keys in canonical order, committed slots 0..prefix-1 then extra,
        its last W gathered (ctx.tail, ctx.h) and the rest read in place, both as the scores' masks (ctx.bias);
        gone: each row's last position out of the window (None: no window); ids: 0, 1, ... (context)."""
        (B, T, E), Hkv, G = extra.shape, self.args.kv_heads, self.args.n_heads // self.args.kv_heads
        valid = extra >= 0
        n = (valid * ids[1:E + 1]).amax(-1, keepdim=True)  # (B, T, 1) the extra keys a row's order holds
        m = n - W  # the tail's start, from prefix on
        # the tail: of the W committed keys before prefix, then extra, the W from the tail's start on
        at = torch.cat((prefix - W + ids[:W], extra), -1).gather(-1, n + ids[:W])  # (B, T, W) < 0: none
        if gone is not None:  # committed keys out of the window
            at = torch.where((at <= gone) & (ids[:W] < -m), -1, at)
        # in place: committed slots below the tail's start, and any extra before it (rows that see more extra
        # keys than the tail holds, never a verified row's), in slot order; column S collects the rest
        seen = ids[:S + 1] < prefix + m.clamp(max=0)
        if gone is not None:
            seen &= ids[:S + 1] > gone
        seen = seen.scatter_(-1, torch.where((ids[:E] < m) & valid, extra, ids[S]), True)[..., :S]
        dt = self.embed.weight.dtype  # the masks as the scores' biases (log 1 = 0, log 0 = -inf), written whole
        bias_in = seen.to(dt)[:, None, :, None].expand(B, Hkv, T, G, S).log().reshape(B * Hkv, T * G, S)
        bias_tail = (at >= 0).to(dt)[:, None, :, None].expand(B, Hkv, T, 1, W).log().reshape(-1, 1, W)
        ctx.tail, ctx.bias, ctx.h = at.clamp(min=0)[:, None], (bias_in, bias_tail), ids[:Hkv, None, None]
        return ctx

    def forward(self, block: Block, cache=None, exact: bool = False, tail: int = 1, dev=None):
        """Logits (B, T, V) for the block's rows. cache=None (training): row t's key is slot t, so the
        block's slots must be 0..T-1 and visibility refers to rows (training.causal: a plain LM block)."""
        S, ids = (cache.k.shape[-2], cache.ids) if cache else (len(block), None)
        ctx = self.context(block, S, exact, tail=tail, dev=dev, ids=ids)
        x = self.embed(block.tokens)
        for i, layer in enumerate(self.layers):
            x = ctx.layer(layer, x, cache.layer(i) if cache else None)
        return ctx.mm(self.lm_head, ctx.rows(self.norm(x)))
