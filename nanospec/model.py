"""A Llama, as plain modules that compute it: check it against HF's LlamaForCausalLM line by line.

The families beside Llama are data in ModelArgs: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's sliding
window. A forward's rows come with `ctx` (forward.Context, made from a Block of rows with explicit positions, cache
slots and visibility): the one object through which the model reaches what is not a Llama's math, as gpt-fast's model
is compiled from outside. It holds each row's RoPE angles (ctx.cos, ctx.sin) and runs, in the form a device or a
method needs, each product (ctx.linear: `proj(x)`), each elementwise kernel (ctx.elementwise), the cache write
(ctx.write), attention over the keys each row sees (ctx.attend: exact mode's canonical order, exact.py, or SDPA) and
each layer (ctx.layer: exact mode adds a residual inside its product's kernel, forward.exact_layer).

Names against HF's (nanospec's = HF's): embed = model.embed_tokens, layers[i].attn = self_attn, attn_norm =
input_layernorm, mlp_norm = post_attention_layernorm, norm = model.norm, lm_head = lm_head; attn.qkv = q_proj, k_proj
and v_proj stacked, mlp.gate_up = gate_proj and up_proj stacked (fused.py: checkpoints keep HF's parts). ModelArgs:
dim = hidden_size, n_layers = num_hidden_layers, n_heads = num_attention_heads, n_kv_heads = num_key_value_heads,
head_dim = head_dim, intermediate_size = intermediate_size, norm_eps = rms_norm_eps, rope_theta = rope_theta,
rope_scaling = rope_scaling, tie_embeddings = tie_word_embeddings, max_seq_len = max_position_embeddings,
sliding_window = sliding_window (Mistral); qkv_bias and qk_norm: Qwen2's and Qwen3's, by their model types.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fused import Product, fuse
from .rope import KINDS, inv_freq


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads (MHA)
    vocab_size: int = 4096
    intermediate_size: int = 688  # SwiGLU's inner width (HF's name; HF's hidden_size is dim)
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5  # HF's rms_norm_eps: every RMSNorm's, Qwen3's q_norm and k_norm included
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


def rms_norm(x, weight, eps: float):
    """x's last dim RMS-normed in fp32, rounded to x's dtype, then scaled by weight (HF's order)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def apply_rope(x, cos, sin):
    """x (B, T, heads, D) rotated (q's heads, then k's); cos, sin (B, T, 1, D), sin signed
    (-sin, sin): HF's x * cos + cat(-x2, x1) * sin bit for bit (a negation is exact), in four ops."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads, args.hd
        H, Hkv = args.n_heads * args.hd, args.kv_heads * args.hd
        # qkv is HF's q_proj, k_proj and v_proj stacked as one product (fused.py; gpt-fast's wqkv): its output viewed
        # (B, T, n_heads + 2 n_kv_heads, hd) holds HF's query heads, then key heads, then value heads
        fuse(self, "qkv", args.dim, {"q_proj": H, "k_proj": Hkv, "v_proj": Hkv}, bias=args.qkv_bias)
        # Qwen3: q_norm and k_norm both take the one norm_eps, as HF's both take rms_norm_eps (attention() merges them)
        self.q_norm, self.k_norm = (RMSNorm(args.hd, args.norm_eps) for _ in "qk") if args.qk_norm else (None, None)
        self.o_proj = Product(H, args.dim, "o_proj")

    def attention(self, x, ctx, kv):
        """The query heads' attention outputs (B, T, H * D), before o_proj; kv: the layer's keys and values."""
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv
        qkv = ctx.linear(self.qkv, x).view(B, T, Hq + 2 * Hkv, self.hd)
        qk, v = qkv[:, :, :Hq + Hkv], qkv[:, :, Hq + Hkv:]  # q's heads and k's together: one norm, one RoPE
        if self.q_norm is not None:  # Qwen3: HF's q_norm(q), k_norm(k) as one norm, each at norm_eps, before RoPE
            w = torch.cat((self.q_norm.weight.expand(Hq, -1), self.k_norm.weight.expand(Hkv, -1)))
            qk = rms_norm(qk, w, self.q_norm.eps)
        qk = apply_rope(qk, ctx.cos, ctx.sin)
        q, k = qk[:, :, :Hq].view(B, T, Hkv, Hq // Hkv, self.hd), qk[:, :, Hq:]  # query head i reads key head i // G
        return ctx.attend(q, ctx.write(kv, k, v))

    def forward(self, x, ctx, kv):
        return ctx.linear(self.o_proj, self.attention(x, ctx, kv))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # gate_up is HF's gate_proj's rows, then up_proj's, as one product (fused.py): chunk(2) splits its output
        fuse(self, "gate_up", args.dim, {"gate_proj": args.intermediate_size, "up_proj": args.intermediate_size})
        self.down_proj = Product(args.intermediate_size, args.dim, "down_proj")

    def inner(self, x, ctx):
        """SwiGLU's inner activation, silu(gate) * up (intermediate_size wide), before down_proj."""
        gate, up = ctx.linear(self.gate_up, x).chunk(2, dim=-1)
        return ctx.elementwise(F.silu, gate) * up

    def forward(self, x, ctx):
        return ctx.linear(self.down_proj, self.inner(x, ctx))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, ctx, kv):
        """HF's decoder layer. Exact mode runs forward.exact_layer instead: this layer with each residual added in
        its product's epilogue (keep the two in step)."""
        x = x + self.attn(self.attn_norm(x), ctx, kv)
        return x + self.mlp(self.mlp_norm(x), ctx)


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
        """RoPE's constants for the args as they are: both halves' inverse frequencies and sin's signs (apply_rope),
        kept as fp32 bits in an int32 buffer, so that model.to(dtype) moves them and leaves them fp32."""
        a = self.args
        inv = inv_freq(a.hd, a.rope_theta, a.rope_scaling)
        rope = torch.stack((torch.cat((inv, inv)), torch.cat((-torch.ones_like(inv), torch.ones_like(inv)))))
        self.register_buffer("rope", rope.view(torch.int32).to(device), persistent=False)

    def rope_constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inverse frequencies, sin's signs), each (D,) fp32."""
        rope = self.rope.view(torch.float32)
        return rope[0], rope[1]

    def forward(self, tokens, ctx, kv):
        """Logits (B, T, V) of the rows' tokens (B, T); kv[i]: layer i's keys and values (None: the rows' own)."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = ctx.layer(layer, x, kv[i])
        return ctx.linear(self.lm_head, self.norm(x))
