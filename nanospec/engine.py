"""The decoding loop: prefill, then draft -> verify -> commit until a stop.

A method is a Drafter. Each step the engine asks it for a draft tree rooted at the
last emitted token (draft), lets it run the verification forward (forward: by
default the tree's rows alone; methods add their own rows or loop over the layers
themselves), accepts the longest path AR agrees with (tree.verify), moves that
path's keys into place (commit, via KVCache.compact) and tells the drafter what
was accepted (accepted). Plain AR is the base Drafter: a tree of the root alone.

In exact mode every forward runs exactly Q rows (padded) on a cache of S slots,
so AR and every method must use the same Q and S to compare bitwise: generate()
takes both, and shapes() gives values that fit a set of drafters.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import NanospecError, graphs
from .cache import KVCache
from .model import Block
from .tree import Sampler, Tree, verify

# Exact mode's fewest rows per forward: MKL computes the last rows of a GEMM with 5-11 rows
# on another path than the first ones (tests/test_model.py checks blocks of 16 and more).
MIN_BLOCK = 16
PREFILL_CHUNK_FAST = 256  # fast mode has no block shape to keep; chunks only bound memory
SLOT_BUCKET = 64  # default cache sizes are rounded up to this: prompts of similar length share CUDA graphs


class Decoding:
    """The state of one generation, handed to the drafter at every step (batch of one)."""

    def __init__(self, model, cache: KVCache, exact: bool, Q: int, prompt: list[int], reserved=None):
        self.model, self.cache, self.exact, self.Q = model, cache, exact, Q
        self.reserved = reserved   # the drafter's own cache slots (e.g. BiTA's prompt keys)
        self.device = model.embed.weight.device
        self.prompt = prompt
        self.out: list[int] = []   # tokens emitted so far
        self.last = prompt[-1]     # the root of the next tree: emitted, not yet in the cache
        self.cur = 0               # committed slots 0..cur-1 hold the sequence before `last`

    @property
    def room(self) -> int:
        """Rows the next forward may write: slots cur..capacity-1."""
        return self.cache.capacity - self.cur

    def run(self, block: Block, embeds=None, hidden=False):
        """Run the model on a block (host tensors; padded to Q rows in exact mode); outputs for
        its rows, batch 0. Exact mode on a GPU replays a CUDA graph (graphs.py)."""
        n = len(block)
        if int(block.slots.max()) >= self.cache.trash:  # the sequence's slots, then the drafter's reserved ones
            raise NanospecError(f"a step of {n} rows does not fit the cache at {self.cur} tokens")
        if not self.exact:
            res = self.model(block.to(self.device), self.cache, False, embeds, hidden)
        else:
            if embeds is not None:
                embeds = F.pad(embeds, (0, 0, 0, self.Q - n))
            model, cache = self.model, self.cache
            fn = lambda embeds, *b: model(Block(*b), cache, True, embeds, hidden)
            res = self.graphed(("run", hidden), fn, embeds, *self.fixed(block))
        return tuple(r[0, :n] for r in res) if hidden else res[0, :n]

    def fixed(self, block: Block) -> tuple:
        """An exact-mode block's tensors at fixed shapes: Q rows (padding rows write and read the
        trash slot), each row's visible slots padded to the cache's S. The same every step."""
        if len(block) > self.Q:
            raise NanospecError(f"a step of {len(block)} rows exceeds the exact-mode block of Q={self.Q} rows; "
                                "raise --block")
        b = block.pad(self.Q, self.cache.trash)
        return b.tokens, b.pos, b.slots, b.prefix, F.pad(b.extra, (0, self.cache.n_slots - b.extra.shape[-1]), value=-1)

    def graphed(self, key, fn, *args):
        """fn(*args) on the model's device, through a CUDA graph there (exact mode: fixed shapes).
        A method with its own layer loop passes its exact forward here, keyed by its shape."""
        return graphs.run(self.cache.graphs, key, fn, args, self.device)

    def prefill(self, tokens: list[int]) -> None:
        """Commit tokens in chunks (Q rows in exact mode: the same for every method)."""
        chunk = self.Q if self.exact else PREFILL_CHUNK_FAST
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            self.run(Tree.chain(part[0], part[1:]).block(self.cur))
            self.cur += len(part)

    def commit(self, tree: Tree, path: list[int], tokens: list[int]) -> None:
        """Keep the accepted path's keys (node i sits at slot cur+i) and emit its tokens."""
        self.cache.compact([self.cur + i for i in path], self.cur)
        self.cur += len(path)
        self.out += tokens
        self.last = tokens[-1]

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Drafter:
    """Plain autoregressive decoding; every method subclasses this."""
    name = "ar"
    max_rows = 1        # the most rows one step's forward runs (sizes the exact-mode block)
    reserved_slots = 0  # cache slots for method-owned keys

    def start(self, dec: Decoding) -> None:
        """Called once after prefill, before the first step."""

    def draft(self, dec: Decoding) -> Tree:
        return Tree.chain(dec.last)

    def forward(self, dec: Decoding, tree: Tree) -> torch.Tensor:
        """The verification forward; returns the tree rows' logits (n, V)."""
        return dec.run(tree.block(dec.cur))

    def accepted(self, dec: Decoding, tree: Tree, path: list[int]) -> None:
        """Called after commit with the accepted path (node indices, root first)."""

    def finish(self, dec: Decoding) -> None:
        """Called once when the generation stops."""

    def report(self) -> str:
        """A line of method statistics for the benchmark (e.g. ProPD's pruning rate)."""
        return ""


@dataclass
class Output:
    tokens: list[int]
    stop: str                   # "eos", "max_new_tokens" or "cache_full"
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per step
    forward_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logits: torch.Tensor | None = None  # (new tokens, V) fp32: the logits each token came from

    @property
    def mean_accepted(self) -> float:
        return len(self.tokens) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.decode_s, 1e-9)


def shapes(drafters, prompt_len: int, max_new_tokens: int, Q=None, n_slots=None) -> tuple[int, int]:
    """The exact-mode block Q and cache size S that fit every drafter: runs to compare share them.

    S holds the prompt, its continuation, one step's scratch rows, reserved slots and the trash slot,
    rounded up to a multiple of SLOT_BUCKET.
    """
    Q = Q or max(MIN_BLOCK, *(d.max_rows for d in drafters))
    if Q < MIN_BLOCK:
        raise NanospecError(f"the exact-mode block must have at least {MIN_BLOCK} rows (got --block {Q})")
    S = prompt_len + max_new_tokens + Q + max(d.reserved_slots for d in drafters) + 1
    return Q, n_slots or -(-S // SLOT_BUCKET) * SLOT_BUCKET


def cache_for(model, n_slots: int, exact: bool) -> KVCache:
    """A generation's KV cache. Exact mode on a GPU reuses one per (S, dtype) per model: the CUDA
    graphs captured with a cache are bound to its buffers, so later generations replay them."""
    w = model.embed.weight
    if not (exact and w.is_cuda and graphs.ENABLED):
        return KVCache.for_model(model, n_slots)
    pool = model.__dict__.setdefault("_exact_caches", {})
    key = (n_slots, w.dtype, w.device)
    if key in pool:
        pool[key].reset()
    else:
        pool[key] = KVCache.for_model(model, n_slots)
    return pool[key]


def check_prompt(prompt, vocab_size: int) -> list[int]:
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise NanospecError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise NanospecError(f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}")
    return prompt


@torch.inference_mode()
def generate(model, prompt, drafter: Drafter | None = None, *, max_new_tokens=128, exact=False,
             Q=None, n_slots=None, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             eos_id=None, record_logits=False) -> Output:
    """Decode max_new_tokens after prompt (token ids) with a drafter (None: AR).

    Q: the exact-mode block, n_slots: the cache size S (defaults: shapes([drafter], ...)).
    eos_id None uses the model's; pass -1 to never stop on EOS.
    """
    drafter = drafter or Drafter()
    prompt = check_prompt(prompt, model.args.vocab_size)
    Q, S = shapes([drafter], len(prompt), max_new_tokens, Q, n_slots)
    eos = model.args.eos_id if eos_id is None else eos_id
    cache = cache_for(model, S, exact)
    reserved = cache.reserve(drafter.reserved_slots)
    if len(prompt) > cache.capacity:
        raise NanospecError(f"the prompt has {len(prompt)} tokens but the cache holds {cache.capacity}; "
                            "shorten it or raise --max-len")
    sampler = Sampler(temperature, top_k, top_p, seed, n=max_new_tokens + Q + 1)
    dec = Decoding(model, cache, exact, Q, prompt, reserved)
    res, logits = Output([], "max_new_tokens"), []

    t0 = time.perf_counter()
    dec.prefill(prompt[:-1])
    drafter.start(dec)
    dec.sync()
    t1 = time.perf_counter()
    while len(dec.out) < max_new_tokens:
        if dec.room < 1:
            res.stop = "cache_full"
            break
        tree = drafter.draft(dec)
        assert tree.tokens[0] == dec.last, "a draft tree must be rooted at the last emitted token"
        tf = time.perf_counter()
        tree_logits = drafter.forward(dec, tree)
        dec.sync()
        res.forward_s.append(time.perf_counter() - tf)
        path, toks = verify(tree, tree_logits, sampler, len(dec.out))
        if record_logits:
            logits.append(tree_logits[path].float().cpu())
        dec.commit(tree, path, toks)
        drafter.accepted(dec, tree, path)
        res.steps += 1
        res.accepted.append(len(toks))
        if eos in toks:
            res.stop = "eos"
            break
    drafter.finish(dec)
    dec.sync()
    res.prefill_s, res.decode_s = t1 - t0, time.perf_counter() - t1
    n = min(len(dec.out), max_new_tokens)
    if eos in dec.out[:n]:
        n, res.stop = dec.out.index(eos) + 1, "eos"
    elif res.stop == "eos":  # the EOS came after the last token asked for
        res.stop = "max_new_tokens"
    res.tokens = dec.out[:n]
    if record_logits:
        res.logits = torch.cat(logits)[:n]
    return res


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy AR continuations of many prompts at once, in fast mode (self-distillation data).

    Prompts are left-padded: prompt b fills slots start_b..P-1 with positions from 0. Every
    row lists what it sees in `extra` (its own prompt's slots up to itself); a padding row
    sees only itself, so nothing it computes reaches a real row.
    """
    B, P = len(prompts), max(map(len, prompts))
    dev = model.embed.weight.device
    cache = KVCache.for_model(model, P + max_new_tokens, batch=B)
    start = torch.tensor([P - len(p) for p in prompts], device=dev)[:, None, None]  # (B, 1, 1)

    def block(tokens, lo):  # rows for slots lo..lo+T-1 of every sequence
        hi = lo + tokens.shape[1]
        slots = torch.arange(lo, hi, device=dev)
        j = torch.arange(hi, device=dev)
        own = slots[None, :, None] < start  # (B, T, 1): padding rows
        vis = torch.where(own, j == slots[:, None], (j >= start) & (j <= slots[:, None]))  # (B, T, hi)
        pos = (slots - start[:, :, 0]).clamp(min=0)
        return Block(tokens, pos, slots, torch.zeros_like(pos), torch.where(vis, j, -1))

    x = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], device=dev)
    out = []
    for i in range(max_new_tokens):
        nxt = model(block(x, P + i - x.shape[1] if i else 0), cache, False)[:, -1].argmax(-1)
        out.append(nxt)
        x = nxt[:, None]
    return torch.stack(out, 1).tolist()
