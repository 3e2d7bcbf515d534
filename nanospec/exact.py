"""Exact mode: why a tree row at position p gets AR's logits at p, bit for bit.

A row's attention is a reduction over its keys, and a float sum's bits depend on the order of its terms and on the
kernel that adds them. So every row, AR's or a tree's, reduces over the same keys in the same order with the same
kernel. The order is the canonical one: the committed slots 0..committed-1 (committed slot j holds position j), then
`extra`, the row's own keys by depth (a tree node's ancestors, then itself; AR's row: itself). Each row splits that
order where its position alone says, W keys before its end (the tail: a count of keys, at least the deepest path's,
sizes.shapes, rounded up to a multiple of devices.Device.slot_grain, forward.context):

    a tree row at depth 2, at position p = cur + 2 (cur: the committed slots; r the root, a1 the row's parent), W = 4:

    slot:   0   1   ...  cur-2 | cur-1   r    a1   self      r, a1, self: the step's scratch slots, cur on
    scores: read in place      | gathered, canonical order   (every other of the S slots: masked, -inf)
            S columns, slot order       W columns

    AR's row at the same p, once r and a1 are committed at cur and cur + 1:

    slot:   0   1   ...  cur-2 | cur-1  cur  cur+1  cur+2
    scores: read in place      | gathered, canonical order

The committed slots hold AR's keys, by induction over steps. Both runs prefill the prompt alike: chunks of Q tokens,
each a block of Q rows at the shared shapes (engine.Decoding.prefill; a chunk's row with more of its chunk's keys
than W reads its first ones in place, the same in both runs). A step's accepted keys, AR's by what follows, move to
slots cur, cur + 1, ... by a plain copy (cache.KVCache.commit). So committed slot j holds AR's key j.

Both rows read the slots below p - W + 1 in place, as S columns of scores in slot order, and gather their last W
keys into W more columns. The columns hold the same keys (a tree's ancestors hold AR's keys, by induction over
depth), masked keys sit at the same columns for both, and a masked score is -inf (the mask's -inf plus a finite
product), whose weight exp(-inf) is exactly 0. So the scores and their softmax over S + W columns are the same
numbers in both runs; the weighted sums' terms are too wherever a weight is non-zero, and a masked column, whose slot
may hold another value in the other run (a sibling's, a stale one), contributes +-0, which leaves a partial sum that
starts at +0 (as a product's accumulator does) unchanged. Each is a kernel over the same shapes in both runs (two
products for the scores, the softmax, two for the weighted sums), so AR's row and the tree's agree bit for bit.

The output is two partial sums: the S columns' (`bmm`), then the W columns' added to it (`baddbmm`). A float sum
rounds as it goes, so its bits depend on where it is split: both rows split at p - W + 1, which the position alone
fixes, so the first sum adds the same terms (the same weights times the same values, +-0 elsewhere) and the second
adds the same W terms to the same value. Zeros are only zeros if every masked slot holds a finite key and value: a
weight of 0 times an inf or a NaN is NaN, and an infinite key's score is +inf or NaN. The cache is allocated zeroed
and only rows' keys and values are written to it (padding rows into the trash slot, padding columns left zero), so
every slot is finite.

The rest of the model: the embedding (a gather: exact), the products (q, k, v, o; gate, up, down; the lm_head), the
residual adds (each in o's or down's addmm, forward.exact_layer: a product's guarantee covers it), the norms and the
elementwise kernels (SiLU, RoPE's cos and sin) act on each row alone, so a row gets AR's bits if each kernel gives a
row the same bits wherever it sits: at any index of its block, beside any rows, in any batch. That is each device's
guarantee, kept in devices.py and the core:
- a product's row independent of its index: a CPU's BLAS takes paths by a row's alignment (devices.CPU.aligned pads
  every row to 64 bytes; forward.Context.linear applies it to each exact product) and MKL computes the last rows of
  a 5-11 row product on another path (devices.MIN_BLOCK: Q is at least 16);
- a product's row independent of the total rows. cuBLAS picks its kernel by them, so on CUDA a forward always runs
  the same total: Q rows per sequence (Block.pad) for a fixed batch of sequences' blocks, idle ones padded
  (devices.CUDA.block_batch, sizes.block_batch, engine.stack). A CPU's BLAS, norms and softmax give an aligned row
  the same bits at any total of at least 16 rows (tests/test_batch.py), so a CPU runs only the live sequences'
  blocks (devices.Device.block_batch None): k sequences' k * Q rows against AR's Q;
- an elementwise kernel the same code path for every element: a CPU's vectorised kernels end a thread's run with a
  scalar loop. Correctly rounded operations (add, multiply, divide, square root: the norm's rsqrt is 1 / sqrt) give
  the same bits on either path; approximated ones (SiLU's exp, RoPE's cos and sin) do not, and go through
  devices.CPU.elementwise, which pads rows to 64 elements and calls one thread's worth at a time. Softmax's exp runs
  along a row, whose S + W columns are alike for every row;
- attention's kernels over the same shapes: Q rows, S + W columns, the slots and head width laid out at the
  device's grain (devices.Device.grain: every score and value row aligned alike on a CPU). The gathered products
  have G rows, a key head's query heads, and G may be 5-11: MKL's caveat spares them, since query head g is row g
  in both runs.
A GPU's kernels (the base devices.Device) apply the same code to every row and element of a fixed shape: it needs
the fixed total alone. Norms reduce within a row in one kernel, a row's reduction the same whatever the rows around
it (on a GPU at the fixed total, on a CPU at any total). A
compiled layer (compiled.py) is one callable for AR and every method at these shapes; that inductor's generated
loops give a row the same bits at any index is tested (tests/test_compile.py), not argued here.

Both runs must share every shape (Q, the cache's S slots, W and the block batch), the dtype, the Device value (its
`call`: a compiled layer's bits are not an eager one's, compiled.py) and the machine (the same library build and thread
count). decode.py and the bench size the shapes over the method and AR together (sizes.shapes, sizes.block_batch); a
caller of engine.generate passes the same Q, n_slots, tail and block_batch to both. Sized apart, AR's run would split
its sums at other keys and, on a GPU, run other kernels.

What breaks it: a W shorter than a row's path (its ancestors would be read in place, in slot order, not by depth:
the engine refuses such a tree), a key in another column (an off-by-one at the window's or the tail's edge), a
split of the output's sum at another key, a non-finite value in a masked slot, a prompt prefilled another way (one
big block, another Q), and a kernel whose bits depend on a row's index or the total rows (the device's guarantee
above). On a method's side: a tree row that sees the method's own rows (tree.group_rows: none does), a method that
changes a tree row's computation (SDSAT's Context.delta updates its adaptive rows alone, Hidden Transfer's forged
states and BiTA's mask embeddings go into their own rows alone, and exact mode runs every row of a block through
every layer: forward.Forward.layers), and a forward that computes tree rows otherwise than Drafter.forward does
(embed, every layer, norm, the lm_head over every row).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Canonical:
    """Each row's keys in canonical order, as attend reads them."""
    tail_slots: torch.Tensor  # (B, 1, T, W) the slots of each row's last W keys, canonical order (padding: slot 0)
    key_heads: torch.Tensor   # (Hkv, 1, 1) the key heads: with ctx.cache_index, the tail's gather index
    in_place: torch.Tensor    # (B * Hkv, T * G, S) the scores' mask over the slots read in place: 0 seen, -inf not
    gathered: torch.Tensor    # (B * Hkv * T, 1, W) the scores' mask over the tail (every query head's): 0 a key


def canonical(committed, extra, gone, S: int, W: int, Hkv: int, G: int, arange, dtype) -> Canonical:
    """committed (B, T, 1): the committed slots each row sees; extra (B, T, E): its own keys' slots by depth (-1: none);
    gone (B, T, 1): its last position out of the window (None: no window); S: the cache's slots; Hkv, G: key heads
    and query heads per key head; arange: 0, 1, ... on the device (KVCache.arange: views, no new index); dtype:
    the scores'."""
    B, T, E = extra.shape
    own = ((extra >= 0) * arange[1:E + 1]).amax(-1, keepdim=True)  # (B, T, 1) its keys after the committed ones
    start = committed + own - W  # where its tail starts in its order (below committed: the tail holds committed keys)
    # the tail: the last W keys of its order, of [the W committed slots it sees last, then extra] (< 0: none)
    before = committed - W + arange[:W]
    tail = torch.cat((before, extra), -1).gather(-1, own + arange[:W])  # (B, T, W)
    slot = arange[:S + 1]  # column S collects the keys no row reads in place
    in_place = slot < start.clamp(max=committed)  # the committed slots before the tail, in slot order
    if gone is not None:  # keys out of the window: committed ones by their slot, which is their position
        old = arange[:W] < committed - start  # the tail's committed part
        tail = torch.where(old & left_window(tail, gone), -1, tail)
        in_place &= ~left_window(slot, gone)
    # a row with more own keys than W (never a verified row: the engine refuses it) reads its first ones in place
    early = (arange[:E] < start - committed) & (extra >= 0)
    in_place = in_place.scatter_(-1, torch.where(early, extra, arange[S]), True)[..., :S]
    heads, in_place, gathered = arange[:Hkv, None, None], mask(in_place, Hkv, G, dtype), mask(tail >= 0, Hkv, 1, dtype)
    return Canonical(tail.clamp(min=0)[:, None], heads, in_place.view(-1, T * G, S), gathered.view(-1, 1, W))


def left_window(pos: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
    """Which positions (committed slot j holds position j) a row whose last position out of the window is gone no
    longer sees."""
    return pos <= gone


def mask(seen: torch.Tensor, Hkv: int, G: int, dtype) -> torch.Tensor:
    """seen (B, T, K) as the scores' additive mask (B, Hkv, T, G, K), written whole: log 1 = 0, log 0 = -inf."""
    B, T, K = seen.shape
    return seen.to(dtype)[:, None, :, None].expand(B, Hkv, T, G, K).log()


@torch.no_grad()  # inference only: the scores are written into one buffer (out=), which autograd does not follow
def attend(q, kv, ctx):
    """q (B, T, Hkv, G, D), query head h * G + g using key head h; kv (2, B', Hkv, S, D') keys and values (D' >= D: a
    cache's head width may be padded); ctx: the forward's (forward.Context: each sequence's cache row, its index in
    the cache's batch, and the rows' Canonical). Each row's scores: the S slots read in place, then its W gathered
    keys (module docstring)."""
    (B, T, Hkv, G, D), (S, Dc), c = q.shape, kv.shape[-2:], ctx.canonical
    W = c.tail_slots.shape[-1]
    q = F.pad(q.transpose(1, 2), (0, Dc - D)) if Dc > D else q.transpose(1, 2).contiguous()  # (B, Hkv, T, G, D')
    k_tail, v_tail = kv[:, ctx.cache_index, c.key_heads, c.tail_slots]  # (B, Hkv, T, W, D') each: canonical order
    k, v = kv if ctx.cache_rows is None else kv.index_select(1, ctx.cache_rows)  # each sequence's cache row
    scores = q.new_empty(B, Hkv, T, G, S + W)
    in_place_scores = scores.view(-1, T * G, S + W)[..., :S]  # views: the scores are written in one buffer
    gathered_scores = scores.view(-1, G, S + W)[..., S:]
    torch.baddbmm(c.in_place, q.view(-1, T * G, Dc), k.view(-1, S, Dc).transpose(1, 2),
                  alpha=D ** -0.5, out=in_place_scores)
    torch.baddbmm(c.gathered, q.view(-1, G, Dc), k_tail.view(-1, W, Dc).transpose(1, 2),
                  alpha=D ** -0.5, out=gathered_scores)
    weights = F.softmax(scores, dim=-1)  # one kernel: bf16's is computed in fp32 and rounded once, as HF's upcast is
    y = torch.bmm(weights[..., :S].reshape(-1, T * G, S), v.view(-1, S, Dc))  # the keys read in place, then the tail
    y = torch.baddbmm(y.view(-1, G, Dc), weights[..., S:].reshape(-1, G, W), v_tail.view(-1, W, Dc))
    return y.view(B, Hkv, T, G, Dc)[..., :D].transpose(1, 2).contiguous().view(B, T, Hkv * G * D)
