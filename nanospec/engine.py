"""The decoding loop: prefill, then draft -> verify -> commit until a stop.

A method is a Drafter, and reads as its paper:
- draft(dec) proposes a tree rooted at the last emitted token, usually from dec.cands: the
  ranked candidates per depth that the last accepted node drafted in the previous step.
- rows(dec, tree) lays the step out as rows: the tree's, then the method's own (mask tokens,
  pseudo states, adaptive tokens); size(n) says how many an n-node tree needs.
- forward(f, nodes) is the verification forward on a Forward f (forward.py); it returns an Out:
  the nodes' logits, and per node the drafts that node would make if it ended the accepted path.
- propose(drafts, mm) turns the last accepted node's drafts into logits per depth (K, V), its
  vocabulary products through mm(layer, x) (fast mode's tuned kernels: kernels.py).
- accepted(dec, tree, path) is told what was accepted (Lookahead's trie, ProPD's statistics).
The core does the rest: it trims a tree to the cache's room, pads exact-mode blocks, verifies on
the device and takes the next candidates' top-k there (greedy), all as one program that is one
CUDA graph in exact mode on a GPU, and reads back the accepted path and the candidates: one
host-device synchronisation per step. Plain AR is the base Drafter: a tree of the root alone.

In exact mode every forward runs exactly Q rows (padded) on a cache of S slots, so AR and every
method must use the same Q and S to compare bitwise: generate() takes both, and shapes() gives
values that fit a set of drafters.
"""
import functools
import hashlib
import json
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import NanospecError, graphs, kernels
from .cache import KVCache
from .files import atomic_write, cache_root, fingerprint, hardware
from .forward import Forward, Out
from .model import Block
from .planner import Measured
from .tree import Sampler, Tree, accept, layout, step_layout, verify

# Exact mode's fewest rows per forward: MKL computes the last rows of a GEMM with 5-11 rows
# on another path than the first ones (tests/test_model.py checks blocks of 16 and more).
MIN_BLOCK = 16
PREFILL_CHUNK_FAST = 256  # fast mode has no block shape to keep; chunks only bound memory
SLOT_BUCKET = 64  # default cache sizes are rounded up to this: prompts of similar length share CUDA graphs


@dataclass
class Nodes:
    """A step's tree as the forward sees it, on the device (padded to Q nodes in exact mode)."""
    tokens: torch.Tensor  # (N,) -1 for padding
    lay: object           # tree.Layout
    real: torch.Tensor    # (N,) bool
    n: int                # real nodes


class Drafter:
    """Plain autoregressive decoding; every method subclasses this (see the module docstring)."""
    name = "ar"
    max_rows = 1        # the most rows one step's forward runs (sizes the exact-mode block)
    reserved_slots = 0  # cache slots for method-owned keys
    topk: list[int] = []  # candidates kept per draft depth
    family = None       # the rank paths a planned tree may use (None: any; see planner.Planner)
    planner = None      # the draft budget per step (planner.py); None: the method's static tree
    nested = False      # unranked drafts only: the first s+1 nodes of a budget-B tree are its budget-s tree

    def plan(self, planner) -> "Drafter":
        """Size each step's tree with planner: ranked drafters may then use any of their top-R ranks."""
        self.planner = planner
        if self.topk and self.family is None:
            acc = getattr(self, "acc", None)  # held-out accuracy per depth and rank
            R = len(acc[0]) if acc else 10
            self.topk = [max(R, *self.topk)] * len(self.topk)
        self.max_rows = max(self.max_rows, self.size(1 + max(planner.sizes)))
        return self

    def start(self, dec: "Decoding") -> None:
        """Called once after prefill, before the first step."""

    def draft(self, dec: "Decoding") -> Tree:
        return Tree.chain(dec.last)

    def size(self, n: int) -> int:
        """Rows a step over a tree of n nodes runs."""
        return n

    def rows(self, dec: "Decoding", tree: Tree) -> Block:
        return dec.block(tree)

    def shape_key(self, nodes: Nodes):
        """What the forward's computation depends on besides its inputs' shapes (nodes.n, the tree size
        when the method's rows depend on it): exact mode captures a CUDA graph per key."""
        return None

    def forward(self, f: Forward, nodes) -> Out:
        return Out(f.logits(f.norm(f.layers(f.embed())), len(nodes.real)))

    def context(self, dec: "Decoding") -> int:
        """For a drafter without ranked candidates, what its planner conditions a budget's gain on
        (planner.Planner): one context unless the method knows better."""
        return 0

    def propose(self, drafts: torch.Tensor, mm) -> torch.Tensor:
        """Logits per draft depth (K, V) from the last accepted node's drafts (K', D); a bias-free
        layer's product runs as mm(layer, x) (Decoding.mm)."""
        return drafts

    def accepted(self, dec: "Decoding", tree: Tree, path: list[int]) -> None:
        """Called after commit with the accepted path (node indices, root first)."""

    def finish(self, dec: "Decoding") -> None:
        """Called once when the generation stops."""

    def report(self) -> str:
        """A line of method statistics for the benchmark (e.g. ProPD's pruning rate, the budgets)."""
        return self.planner.report() if self.planner is not None else ""


AR = Drafter()  # the one AR drafter: every AR step (budget 0, no room to draft) reuses its step program


class Decoding:
    """The state of one generation, handed to the drafter at every step (batch of one)."""

    def __init__(self, model, cache: KVCache, exact: bool, Q: int, prompt: list[int], reserved=None,
                 sampler: Sampler | None = None):
        self.model, self.cache, self.exact, self.Q = model, cache, exact, Q
        self.reserved = reserved   # the drafter's own cache slots (e.g. BiTA's prompt keys)
        self.device = model.embed.weight.device
        self.sampler = sampler or Sampler()
        self.prompt = prompt
        self.out: list[int] = []   # tokens emitted so far
        self.last = prompt[-1]     # the root of the next tree: emitted, not yet in the cache
        self.cur = 0               # committed slots 0..cur-1 hold the sequence before `last`
        self.cands = None          # (D, R) on the device: ranked candidates per depth from the last step
        self.cand_lists = None     # the same, on the host
        self.template = None       # a ranked drafter's tree shape for this step (its own, or the planner's)
        self.budget = None         # this step's draft budget in nodes, when a planner sets one
        self.forward_s = 0.0       # time in forwards (synchronised), for the benchmark's host time
        self.reserved_slots = tuple(reserved.tolist()) if reserved is not None else ()
        self.cuda = self.device.type == "cuda"

    def block(self, tree: Tree, hosts=(), M: int = 0, reserved: bool = False, chained: bool = True) -> Block:
        """The tree's rows at the current position, on the device, then (M > 0) a group of M rows
        after each host node (tree.group_rows; reserved: they also see the drafter's reserved slots).
        Laid out once per shape at position 0 (tree.step_layout) and moved to cur: a few device ops."""
        b, seq = step_layout(tree.parents, tuple(hosts), M, self.reserved_slots if reserved else (), chained,
                             self.cache.capacity, self.device)
        tokens = self.tokens(tree)
        if len(b) > len(tree):
            tokens = F.pad(tokens, (0, len(b) - len(tree)))
        cur = self.cur
        return Block(tokens.view(1, -1), b.pos + cur, b.slots + cur, b.prefix + cur, torch.where(seq, b.extra + cur, b.extra))

    def tokens(self, tree: Tree) -> torch.Tensor:
        """The tree's tokens on the device (drafted there already, or sent from the host list)."""
        t = tree.tokens
        return t if torch.is_tensor(t) and t.device == self.device else torch.as_tensor(t, device=self.device)

    def keep(self, keys=None, values=None, embeds=None) -> None:
        """Fill the drafter's reserved cache slots: with per-layer keys and values as given, or with
        those that rows of embeds compute, causal among themselves from position 0 (BiTA's deep and
        shallow prompts)."""
        slots = self.reserved
        if embeds is None:
            for i, (k, v) in enumerate(zip(keys, values)):
                kc, vc = self.cache.layer(i)
                kc[:, :, slots] = k
                vc[:, :, slots] = v
            return
        P = len(slots)
        extra = torch.where(torch.arange(P)[None] <= torch.arange(P)[:, None], slots[None], -1)
        z = torch.zeros(1, P, dtype=torch.long)
        self.run(Block(z, torch.arange(P)[None], slots, z, extra[None]), embeds=embeds[None])

    @property
    def room(self) -> int:
        """Rows the next forward may write: slots cur..capacity-1."""
        return self.cache.capacity - self.cur

    def fit(self, drafter: Drafter, tree: Tree) -> tuple[Drafter, Tree]:
        """The tree trimmed to the cache's room; with no room even for the root's own rows, the step
        is plain AR (the method drafts nothing next)."""
        m = len(tree)
        while m > 1 and drafter.size(m) > self.room:
            m -= 1
        if drafter.size(m) > self.room:
            return AR, tree.prefix(1)
        return drafter, tree.prefix(m)

    def program(self, drafter: Drafter, block: Block, nodes: Nodes, greedy: bool):
        """The step's device program: the method's forward, then (greedy) verification and the next
        candidates' top-k. Exact mode: fixed shapes, one CUDA graph per method and shape key."""
        model, cache, exact = self.model, self.cache, self.exact
        R = max(drafter.topk, default=1)

        def run(tokens, pos, slots, prefix, extra, node_tokens, parent, depth, index, anc, real):
            f = Forward.on_cache(model, Block(tokens, pos, slots, prefix, extra), cache, exact)
            lay = type(nodes.lay)(parent, depth, index, anc)
            out = drafter.forward(f, Nodes(node_tokens, lay, real, nodes.n))
            N = len(node_tokens)  # drafts may cover the real nodes only: pad them to the padded tree
            if out.drafts is not None and len(out.drafts) < N:
                out.drafts = F.pad(out.drafts, (0, 0, 0, 0, 0, N - len(out.drafts)))
            if out.depths is not None and len(out.depths) < N:
                out.depths = F.pad(out.depths, (0, N - len(out.depths)))
            if not greedy:
                return out.logits, out.drafts, out.depths, out.alive
            path, emitted = accept(node_tokens, lay, out.logits, out.alive)
            head = [path, emitted]
            if out.drafts is not None:
                last = path.max().view(1)  # the path's deepest node (indices grow along a path); no host sync
                cands = drafter.propose(out.drafts[last][0], self.mm).topk(R, dim=-1).indices  # (K, R)
                k = out.depths[last] if out.depths is not None else torch.full_like(last, len(cands))
                head += [k, cands.flatten()]
            return torch.cat(head), out.logits
        lay = nodes.lay
        args = (*(block.tokens, block.pos, block.slots, block.prefix, block.extra),
                nodes.tokens, lay.parent, lay.depth, lay.index, lay.anc, nodes.real)
        key = ("step", id(drafter), drafter.shape_key(nodes) if exact else None, greedy)  # the graph keeps drafter alive
        return graphs.run(cache.graphs, key, run, args, self.device)

    def prepare(self, drafter: Drafter, tree: Tree) -> tuple[Block, Nodes]:
        """A step's rows and nodes on the device; exact mode pads both to Q."""
        n = len(tree)
        tokens, real = self.tokens(tree), ones(n, self.device)
        block = drafter.rows(self, Tree(tokens, tree.parents))  # the tokens go to the device once
        # rows write slots cur..cur+len-1: past the capacity lie the reserved slots and the trash slot
        assert len(block) <= self.room, f"a step of {len(block)} rows overruns the cache ({self.room} slots left)"
        lay = layout(tree.parents, self.device)
        if self.exact:
            block, lay = self.fixed(block), lay.pad(self.Q)
            tokens, real = F.pad(tokens, (0, self.Q - n), value=-1), F.pad(real, (0, self.Q - n))
        return block, Nodes(tokens, lay, real, n)

    def step(self, drafter: Drafter, tree: Tree, record: bool):
        """Verify a tree: the method's forward, greedy verification on the device and its next
        candidates, with one read-back (sampling verifies on the host).
        Returns (the tree as verified, path, emitted tokens, the path's logits if record)."""
        drafter, tree = self.fit(drafter, tree)
        n = len(tree)
        block, nodes = self.prepare(drafter, tree)
        greedy = self.sampler.greedy
        self.sync()
        t0 = time.perf_counter()
        res = self.program(drafter, block, nodes, greedy)
        self.sync()
        self.forward_s += time.perf_counter() - t0
        E = nodes.lay.anc.shape[1]
        if greedy:
            packed, logits = res
            head = packed.tolist()  # the step's one read-back
            path = [i for i in head[:E] if i >= 0]
            emitted = head[E:E + len(path)]
            cands = packed[2 * E + 1:].view(-1, max(drafter.topk, default=1)) if len(head) > 2 * E else None
            depth = head[2 * E] if cands is not None else 0
        else:
            logits, drafts, depths, alive = res
            path, emitted = verify(tree, logits[:n], self.sampler, len(self.out), None if alive is None else alive[:n])
            cands, depth = None, 0
            if drafts is not None:
                cands = drafter.propose(drafts[path[-1]], self.mm).topk(max(drafter.topk), dim=-1).indices
                depth = int(depths[path[-1]]) if depths is not None else len(cands)
        self.cands = cands[:depth] if cands is not None and depth > 0 else None
        self.cand_lists = self.cands.tolist() if self.cands is not None else None
        return tree, path, emitted, logits[path].float().cpu() if record else None

    def fixed(self, block: Block) -> Block:
        """An exact-mode block at fixed shapes: Q rows (padding rows write and read the trash slot),
        each row's visible slots padded to the cache's S. The same every step."""
        if len(block) > self.Q:
            raise NanospecError(f"a step of {len(block)} rows exceeds the exact-mode block of Q={self.Q} rows; "
                                "raise --block")
        b = block.pad(self.Q, self.cache.trash)
        b.extra = F.pad(b.extra, (0, self.cache.n_slots - b.extra.shape[-1]), value=-1)
        return b

    def run(self, block: Block, embeds=None) -> torch.Tensor:
        """A forward without verification (prefill, BiTA's shallow prompt rows): logits of the
        block's rows. Exact mode pads to Q rows and replays a CUDA graph on a GPU."""
        n = len(block)
        if int(block.slots.max()) >= self.cache.trash:  # the sequence's slots, then the drafter's reserved ones
            raise NanospecError(f"a step of {n} rows does not fit the cache at {self.cur} tokens")
        model, cache, exact = self.model, self.cache, self.exact
        block = self.fixed(block) if exact else block.to(self.device)
        if embeds is not None and exact:
            embeds = F.pad(embeds, (0, 0, 0, self.Q - n))

        def run(embeds, *b):
            f = Forward.on_cache(model, Block(*b), cache, exact)
            x = f.embed() if embeds is None else embeds
            return f.logits(f.norm(f.layers(x)), len(f.block))
        args = (embeds, block.tokens, block.pos, block.slots, block.prefix, block.extra)
        return graphs.run(cache.graphs, ("run",), run, args, self.device)[:n]

    def prefill(self, tokens: list[int]) -> None:
        """Commit tokens in chunks (Q rows in exact mode: the same for every method)."""
        chunk = self.Q if self.exact else PREFILL_CHUNK_FAST
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            self.run(Tree.chain(part[0], part[1:]).block(self.cur))
            self.cur += len(part)

    def commit(self, path: list[int], tokens: list[int]) -> None:
        """Keep the accepted path's keys (node i sits at slot cur+i) and emit its tokens."""
        self.cache.compact([self.cur + i for i in path], self.cur)
        self.cur += len(path)
        self.out += tokens
        self.last = tokens[-1]

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mm(self, layer, x):
        """A drafter's bias-free product layer(x), on fast mode's tuned kernels when set: a few rows
        through a large lm_head cost a fraction of F.linear's time in the weight-first form."""
        return kernels.mm(None if self.exact else self.model.kernels, layer, x)


@dataclass
class Output:
    tokens: list[int]
    stop: str                   # "eos", "max_new_tokens" or "cache_full"
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per step
    forward_s: float = 0.0      # time in the steps' forwards (device-synchronised)
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


COST_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
COSTS_VERSION = 2  # bumped when the code changes what a forward costs: cached measures are then stale


@torch.inference_mode()
def measure_costs(model, exact: bool = False, rows=COST_ROWS, context: int = 256, reps: int = 5) -> Measured:
    """Seconds per forward of n rows after `context` tokens, on this machine, model, dtype and mode:
    measured once and cached under the cache root, keyed by all four. The row counts take turns,
    reps rounds, and each keeps its fastest: a busy spell of a shared machine then slows one round
    of every count, not every round of one."""
    w = model.embed.weight
    forms = "" if exact or model.kernels is None else "-" + hashlib.sha256(model.kernels.to_json().encode()).hexdigest()[:8]
    key = f"{fingerprint(model)}-{hardware(w.device)}-{w.dtype}-{'exact' if exact else 'fast'}{forms}-{COSTS_VERSION}"
    path = cache_root() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.is_file():
        return Measured({int(r): t for r, t in json.loads(path.read_text())["seconds"].items()})
    Q = max(MIN_BLOCK, *rows)
    cache = KVCache.for_model(model, context + Q + 1)
    dec = Decoding(model, cache, exact, Q, [0] * (context + 1))
    dec.prefill(torch.randint(0, model.args.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist())
    blocks = {n: Tree.chain(1, [1] * (n - 1)).block(dec.cur) for n in rows}
    points = {}
    for rep in range(reps + 1):  # the first round warms up
        for n, block in blocks.items():
            dec.sync()
            t0 = time.perf_counter()
            dec.run(block)
            dec.sync()
            if rep:
                points[n] = min(points.get(n, math.inf), time.perf_counter() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(json.dumps({"key": key, "seconds": points}, indent=1)))
    return Measured(points)


@functools.lru_cache(maxsize=256)
def ones(n: int, device) -> torch.Tensor:
    """n True flags on the device, made once (every real node of a fast-mode step); read-only."""
    return torch.ones(n, dtype=torch.bool, device=device)


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


def check_room(prompt_len: int, capacity: int) -> None:
    if prompt_len > capacity:
        raise NanospecError(f"the prompt has {prompt_len} tokens but the cache holds {capacity}; "
                            "shorten it or raise --max-len")


@torch.inference_mode()
def generate(model, prompt, drafter: Drafter | None = None, *, max_new_tokens=128, exact=False,
             Q=None, n_slots=None, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             eos_id=None, record_logits=False) -> Output:
    """Decode max_new_tokens after prompt (token ids) with a drafter (None: AR).

    Q: the exact-mode block, n_slots: the cache size S (defaults: shapes([drafter], ...)).
    eos_id None uses the model's; pass -1 to never stop on EOS.
    """
    drafter = drafter or AR
    prompt = check_prompt(prompt, model.args.vocab_size)
    Q, S = shapes([drafter], len(prompt), max_new_tokens, Q, n_slots)
    eos = model.args.eos_id if eos_id is None else eos_id
    cache = cache_for(model, S, exact)
    reserved = cache.reserve(drafter.reserved_slots)
    check_room(len(prompt), cache.capacity)
    sampler = Sampler(temperature, top_k, top_p, seed, n=max_new_tokens + Q + 1)
    dec = Decoding(model, cache, exact, Q, prompt, reserved, sampler)
    res, logits = Output([], "max_new_tokens"), []

    t0 = time.perf_counter()
    dec.prefill(prompt[:-1])
    drafter.start(dec)
    dec.sync()
    t1 = time.perf_counter()
    planner = drafter.planner
    if planner is not None:
        planner.start(drafter, dec)
    while len(dec.out) < max_new_tokens:
        if dec.room < 1:
            res.stop = "cache_full"
            break
        ts = time.perf_counter()
        dec.template = getattr(drafter, "template", None)
        if planner is not None:
            dec.budget = planner.budget(drafter, dec)
            dec.template = planner.tree or dec.template
        step = drafter if dec.budget != 0 else AR  # budget 0: drafting does not pay, an AR step
        tree, path, toks, rows = dec.step(step, step.draft(dec), record_logits)
        if record_logits:
            logits.append(rows)
        dec.commit(path, toks)
        drafter.accepted(dec, tree, path)
        if planner is not None:
            planner.observe(dec, dec.budget, step.size(len(tree)), len(path) - 1, time.perf_counter() - ts,
                            path, len(tree) - 1)
        res.steps += 1
        res.accepted.append(len(toks))
        if eos in toks:
            res.stop = "eos"
            break
    drafter.finish(dec)
    dec.sync()
    res.prefill_s, res.decode_s, res.forward_s = t1 - t0, time.perf_counter() - t1, dec.forward_s
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
