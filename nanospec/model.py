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
    h: torch.Tensor | None = None      # (1, Hkv, 1, 1) the key heads: with b, the tail's gather indices
    mask: torch.Tensor | None = None   # fast: (B, T, L) visible slots; None = all of 0..L-1
    L: int = 0                         # fast: number of cache slots in use
    seqs: torch.Tensor | None = None   # (B,) the cache rows of the block's sequences; None: 0..B-1
    delta: object = None               # delta(layer, x, y): a product's update on some rows (SDSAT's adaptive rows)
    dev: Device = NEUTRAL              # the device's layout and speed (devices.py), as the forward's caller chose

    def rows(self, x):
        """Matmul input: in exact mode, as the device's products need it (devices.Device.rows)."""
        return self.dev.rows(x) if self.exact else x

    def layer(self, layer, x, kc, vc):
        """A layer over the rows: in exact mode through the device's callable for it, if any (a compiled layer)."""
        call = self.dev.call if self.exact else None
        return layer(x, self, kc, vc) if call is None else call(layer, x, self, kc, vc)

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

    def write(self, kc, vc, k, v):
        """Store the rows' keys and values (B, T, Hkv, D) in their sequences' cache rows; returns (kc, vc)."""
        b = None if self.seqs is None and self.slots.dim() == 1 else self.b.view(-1, 1)
        for c, x in ((kc[..., :k.shape[-1]], k), (vc[..., :v.shape[-1]], v)):  # a cache's head width may be padded
            if b is None:  # one row of slots for the batch: the faster copy
                c.index_copy_(2, self.slots, x.transpose(1, 2))
            else:
                c[b, :, self.slots] = x  # advanced indices first: (B, T, Hkv, D)
        return kc, vc


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, weight=None):  # weight: in place of its own (Attention: q's and k's at once)
        xf, w = x.float(), self.weight if weight is None else weight
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def apply_rope(x, cos, sin):
    """x (B, T, ..., D) rotated; cos, sin (B, T, 1, 1, D), sin signed (-sin, sin): HF's x * cos + cat(-x2, x1) * sin
    bit for bit (a negation is exact), in four ops."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


@torch.no_grad()  # inference only: the scores are written into one buffer (out=), which autograd does not follow
def attend_exact(q, kc, vc, ctx):
    """q (B, T, Hkv, G, D), query head h * G + g using key head h; kc, vc (B, Hkv, S, D') (D' >= D: a cache's
    head width may be padded). Each row reduces over its keys in canonical order, split where its position alone
    says: the keys before its last W are read in place, in slot order; the last W are gathered, in canonical
    order. AR's row at the same position splits at the same key, so a tree row's scores, softmax and weighted
    sums are AR's bit for bit, and no row copies more than W keys of the cache."""
    (B, T, Hkv, G, D), (S, Dc), W = q.shape, kc.shape[-2:], ctx.tail.shape[-1]
    q = F.pad(q.transpose(1, 2), (0, Dc - D)) if Dc > D else q.transpose(1, 2).contiguous()  # (B, Hkv, T, G, D')
    kt, vt = (c[ctx.b, ctx.h, ctx.tail] for c in (kc, vc))  # (B, Hkv, T, W, D'): the tails, canonical order
    if ctx.seqs is not None:  # a subset of the cache's rows: theirs alone
        kc, vc = kc.index_select(0, ctx.seqs), vc.index_select(0, ctx.seqs)
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


def attend_fast(q, kc, vc, ctx):
    """SDPA over cache slots 0..L-1; query heads folded into rows so GQA needs no key copy."""
    B, T, Hkv, G, D = q.shape
    seqs = slice(None) if ctx.seqs is None else ctx.seqs
    k, v = kc[seqs, :, :ctx.L, :D], vc[seqs, :, :ctx.L, :D]  # (B, Hkv, L, D): a cache's head width may be padded
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

    def forward(self, x, ctx: Context, kc, vc, residual):
        B, T, _ = x.shape
        G = self.n_heads // self.n_kv
        qkv = ctx.mm(self.qkv, ctx.rows(x)).view(B, T, self.n_kv, G + 2, self.hd)
        qk = qkv[:, :, :, :G + 1]  # (B, T, Hkv, G + 1, D)
        if self.q_norm is not None:  # each head of q and of k normed by its own weight, before RoPE
            qk = self.q_norm(qk, torch.cat((self.q_norm.weight.expand(G, -1), self.k_norm.weight[None])))
        qk = apply_rope(qk, ctx.cos, ctx.sin)
        q, k, v = qk[:, :, :, :G], qk[:, :, :, G], qkv[:, :, :, G + 1]
        # no cache (training): the rows' own keys are slots 0..T-1
        kc, vc = (k.transpose(1, 2), v.transpose(1, 2)) if kc is None else ctx.write(kc, vc, k, v)
        y = (attend_exact if ctx.exact else attend_fast)(q, kc, vc, ctx)
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

    def forward(self, x, ctx, kc, vc):
        x = self.attn(self.attn_norm(x), ctx, kc, vc, residual=x)
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
        """RoPE's constants in fp32, whatever the weights: both halves' frequencies, sin's signs (apply_rope)."""
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

    def context(self, block: Block, n_slots: int, exact: bool, seqs=None, tail: int = 1, dev=None) -> Context:
        """The block's attention inputs. n_slots: the cache's (its physical slots); tail: in exact mode the keys each
        row gathers in canonical order (at least the deepest row's ancestors and itself; the rest it reads in place);
        dev: the device's layout and speed (default: devices.of the block's device)."""
        dev = devices.of(block.extra.device) if dev is None else dev
        ctx = Context(*self.rope(block.pos, dev if exact else None), block.slots, exact, seqs=seqs, dev=dev)
        prefix, extra, win = block.prefix[..., None], block.extra, self.args.sliding_window
        gone = None if win is None else block.pos[..., None] - win  # keys at positions <= gone: out of the window
        if gone is not None:
            at = torch.full((len(extra), n_slots), 1 << 62, device=extra.device)  # each slot's position
            at = at.scatter_(1, block.slots.expand(len(extra), -1), block.pos)
            extra = extra.masked_fill(at.gather(1, extra.clamp(min=0).flatten(1)).view_as(extra) <= gone, -1)
        ctx.b = (torch.arange(len(extra), device=extra.device) if seqs is None else seqs)[:, None, None, None]
        if exact:
            return self.canonical(ctx, prefix, extra, gone, n_slots, tail)
        ctx.L = L = max(int(block.prefix.max()), int(extra.max()) + 1)  # fast: SDPA over slots 0..L-1, masked
        # scatter the extra slots into a (B, T, L+1) mask; column L collects the -1 padding
        j = torch.arange(L + 1, device=extra.device)
        mask = j < prefix
        if gone is not None:
            mask &= j > gone
        mask = mask.scatter_(-1, torch.where(extra < 0, L, extra), True)[..., :L]
        ctx.mask = None if bool(mask.all()) else mask
        return ctx

    def canonical(self, ctx: Context, prefix, extra, gone, n_slots: int, tail: int) -> Context:
        """Exact mode's attention inputs: each row's keys in canonical order, committed slots 0..prefix-1 then extra,
        its last `tail` gathered (ctx.tail, ctx.h) and the rest read in place, both as the scores' masks (ctx.bias);
        gone: each row's last position out of the window (None: no window)."""
        tail -= tail % -ctx.dev.grain(self.embed.weight.dtype)[0]
        (B, T, E), on = extra.shape, extra.device
        Hkv, G = self.args.kv_heads, self.args.n_heads // self.args.kv_heads
        e = torch.arange(E, device=on)
        start = prefix + ((extra >= 0) * (e + 1)).amax(-1, keepdim=True) - tail  # (B, T, 1) the tail's start
        k = start + torch.arange(tail, device=on)  # (B, T, W) the tail's canonical indices
        at = torch.where(k < prefix, k, extra.gather(-1, (k - prefix).clamp(0, E - 1)))
        drop = k < 0
        if gone is not None:  # committed keys out of the window
            drop |= (k < prefix) & (k <= gone)
        at = torch.where(drop, -1, at)
        # in place: committed slots below the tail's start, and any extra before it (rows that see more extra
        # keys than the tail holds, never a verified row's), in slot order; column n_slots collects the rest
        j = torch.arange(n_slots + 1, device=on)
        before = torch.where((e < start - prefix) & (extra >= 0), extra, n_slots)
        seen = j < torch.minimum(start, prefix)
        if gone is not None:
            seen &= j > gone
        seen = seen.scatter_(-1, before, True)[..., :n_slots]
        dt = self.embed.weight.dtype  # the masks as the scores' biases: log 1 = 0, log 0 = -inf
        bias_in = seen.to(dt).log()[:, None, :, None].expand(B, Hkv, T, G, n_slots).reshape(B * Hkv, T * G, -1)
        bias_tail = (at >= 0).to(dt).log()[:, None, :, None].expand(B, Hkv, T, 1, tail).reshape(-1, 1, tail)
        ctx.tail, ctx.bias = at.clamp(min=0)[:, None], (bias_in, bias_tail)
        ctx.h = torch.arange(Hkv, device=on)[None, :, None, None]
        return ctx

    def forward(self, block: Block, cache=None, exact: bool = False, tail: int = 1, dev=None):
        """Logits (B, T, V) for the block's rows. cache=None (training): row t's key is slot t, so the
        block's slots must be 0..T-1 and visibility refers to rows (training.causal: a plain LM block)."""
        ctx = self.context(block, cache.k.shape[-2] if cache else len(block), exact, tail=tail, dev=dev)
        x = self.embed(block.tokens)
        for i, layer in enumerate(self.layers):
            x = ctx.layer(layer, x, *(cache.layer(i) if cache else (None, None)))
        return ctx.mm(self.lm_head, ctx.rows(self.norm(x)))
