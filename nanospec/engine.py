"""The decoding loop: prefill, then steps until a stop. A step (`step`) is the functions below, in this order:

- draft: each live sequence's drafter proposes a tree, on the host, trimmed to its cache's room (drafter.py: the
  contract); the sequences that step alike form a cohort.
- lay out: a cohort's trees become rows and nodes, on the host: the tree's rows, then the groups of rows the drafter
  asks for (Drafter.groups, tree.step_rows), exact mode's padded to Q rows, as one batch (Decoding.prepare, stack).
- launch: one device program per cohort (step_program), its inputs one host tensor: the method's forward, then
  (greedy) the step settled on the device (verify.settle_on_device: the accepted path, the commit of its keys through
  KVCache.commit, the next candidates' top-k).
- read back: greedy, the accepted paths and next candidates, the step's one host-device sync (read_back); sampling,
  the step settled on the host instead (verify.settle_on_host: its own verification, the same commit and candidates).
- advance: each sequence's cursor, tokens and next candidates, on the host (Decoding.advance).

A Decoding is one sequence's generation: its state, handed to its drafter at every step. In exact mode every forward
runs Q rows per sequence on a cache of S slots, each row gathering its last W keys (sizes.shapes); on a device whose
kernels depend on the total rows (CUDA), the blocks of a fixed block batch of sequences, idle ones padded
(sizes.block_batch), so the total never changes (exact.py says why that makes a tree's logits AR's). A device's Programs
(programs.py: CUDA graphs) run the step's and prefill's programs; without one, they run eagerly.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from . import NanospecError, compiled, devices, sizes
from .cache import Block, KVCache, packed, unpacked
from .devices import Device
from .drafter import AR, Drafter
from .forward import Forward
from .programs import of as programs_of
from .sizes import check_prompt, check_room, shapes
from .tree import Layout, Nodes, Tree, step_rows
from .verify import Sampler, Step, settle_on_device, settle_on_host, unpack_results

PREFILL_CHUNK_FAST = 256  # fast mode has no block shape to keep; chunks only bound memory
HOST = torch.device("cpu")  # where a step is drafted and laid out


def step(live: list[Decoding], drafter: Drafter, record: bool):
    """One step of every live sequence, a cohort of one drafter and layout at a time. Returns the budget, per sequence
    its Step, and the step's rows."""
    budget, cohorts = draft(live, drafter)
    results = {}
    for s, members in cohorts:
        decs, trees = [m[0] for m in members], [m[1] for m in members]
        block, nodes, cache_rows = lay_out(decs, s, trees, budget)
        res, t0 = launch_step(decs, s, block, nodes, cache_rows)
        index = [x.cache_row for x in decs] if decs[0].block_batch else list(range(len(decs)))  # each one's batch index
        if decs[0].sampler.greedy:  # verified on the device: (packed results, logits), read back
            logits, found = res[1], read_back(res[0], index, s, nodes)
        else:
            logits, found = res[0], settle_on_host(decs[0].cache, decs[0].dev.forms, s, decs, trees, res, index)
        took = time.perf_counter() - t0  # from the launch to the read-back, shared by the cohort
        for b, (d, tree, whole), (path, emitted, cands, lists, pruned) in zip(index, members, found):
            d.advance(path, emitted, cands, lists, took / len(decs))
            drafter.accepted(d, tree, path)
            kept = logits[b, path].float().cpu() if record else None
            results[d] = Step(tree, path, emitted, budget, s.rows(len(tree), budget),
                              [i for i in pruned if i < len(tree)], kept, whole)
    return budget, results, sum(r.rows for r in results.values())


def draft(live: list[Decoding], drafter: Drafter):
    """The step's budget (the planner's; None: none) and each live sequence's tree, on the host, trimmed to its cache's
    room, in cohorts by the drafter that steps it and its layout: per cohort, (that drafter, [(sequence, tree, the whole
    draft)])."""
    budget, template = drafter.planner.budget(live) if drafter.planner is not None else (None, None)
    stepper = drafter if budget != 0 else AR  # budget 0: drafting does not pay, an AR step
    wide = drafter.nested and budget is not None  # drafted whole, AR steps too: the planner scores every prefix
    cohorts = {}
    for d in live:
        whole = (drafter if wide else stepper).draft(
            d, d.cands, template or drafter.template, None if wide else budget)
        s, tree = d.fit(stepper, whole.prefix(min(len(whole), budget + 1)) if wide else whole, budget)
        key = (id(s), None if d.room >= s.max_rows else len(tree))  # near the cache's end: no filler
        cohorts.setdefault(key, (s, []))[1].append((d, tree, whole))
    return budget, list(cohorts.values())


def lay_out(decs: list[Decoding], drafter: Drafter, trees: list[Tree], budget=None):
    """A cohort's trees as rows and nodes, on the host: each laid out for the cohort's largest (smaller trees get filler
    nodes; exact mode pads to Q rows), then stacked as one batch, with the cohort's cache rows (stack)."""
    n = max(map(len, trees))
    return stack(decs, *zip(*(d.prepare(drafter, t, n, budget) for d, t in zip(decs, trees))))


def launch_step(decs: list[Decoding], drafter: Drafter, block: Block, nodes: Nodes, cache_rows):
    """A cohort's step program (step_program, batch dim first) launched on one host tensor, and its start time. Exact
    mode: fixed shapes, one program per method (and per tree and group size, for a method with group rows; one CUDA
    graph each, on a GPU)."""
    d, lay = decs[0], nodes.lay
    cursors = {x.cache_row: x.cur for x in decs} if d.block_batch else dict(enumerate(x.cur for x in decs))
    cur = torch.tensor([cursors.get(r, 0) for r in range(len(block.tokens))])  # idle sequences: slot 0 onto itself
    flat, spec = packed([block.tokens, block.pos, block.slots, block.committed, block.extra, nodes.tokens, lay.parent,
                         lay.depth, lay.index, lay.anc, nodes.real, cur, cache_rows])
    shape = (nodes.largest, nodes.M) if d.exact and nodes.M else None  # what the forward depends on beyond its inputs
    key = ("step", id(drafter), shape, d.sampler.greedy, spec)
    t0 = time.perf_counter()
    # the program binds d and drafter, and a capture keeps it: it reads only what the cohort shares (model, cache)
    return d.launch(key, functools.partial(step_program, d, drafter, nodes.largest, nodes.M, spec), (flat,)), t0


def step_program(d: Decoding, drafter: Drafter, n: int, M: int, spec: tuple, flat: torch.Tensor):
    """A cohort's step on the device: the method's forward, then (greedy) settle_on_device: each sequence's accepted
    path, its keys committed and its end's drafts' top-k, as one tensor; sampling: the forward's outputs as they are."""
    *blk, tokens, parent, depth, index, anc, real, cur, cache_rows = unpacked(flat, spec)
    f = Forward.on_cache(d.model, Block(*blk), d.cache, d.exact, cache_rows, d.tail, d.dev)
    lay = Layout(parent, depth, index, anc)
    out = drafter.forward(f, Nodes(tokens, lay, real.bool(), n, M))
    if not d.sampler.greedy:
        return out.logits, out.draft_inputs, out.depths, out.alive
    return settle_on_device(d.cache, d.dev.forms, drafter, out, tokens, lay, cur, cache_rows), out.logits


def read_back(flat: torch.Tensor, index: list[int], drafter: Drafter, nodes: Nodes) -> list:
    """A greedy step program's results on the host, read back once (the step's one host-device sync): per sequence
    (index: its row in the batch), its path, emitted tokens, next candidates (D, R) and as lists, and nodes pruned."""
    read, R = flat.tolist(), max(drafter.topk, default=1)
    return [unpack_results(read[b], nodes.lay.anc.shape[-1], R, nodes.N if drafter.prunes else 0) for b in index]


class Decoding:
    """The state of one sequence's generation, handed to its drafter at every step. A batch is a Decoding per
    sequence on one cache, each with its own cache row (cache_row) and cursor (cur)."""

    def __init__(self, model, cache: KVCache, exact: bool, Q: int, prompt: list[int], reserved=None,
                 sampler: Sampler | None = None, cache_row: int = 0, block_batch: int | None = None,
                 dev: Device | None = None, tail: int | None = None, programs=None):
        if exact and Q < devices.MIN_BLOCK:  # fewer rows would put some on another kernel path (exact.py)
            raise NanospecError(f"the exact-mode block must have at least {devices.MIN_BLOCK} rows (got Q={Q})")
        self.model, self.cache, self.exact, self.Q = model, cache, exact, Q
        # exact mode: the keys each row gathers in canonical order (generate's: sizes.shapes' W; none given: Q, the
        # deepest path a block holds)
        self.tail = tail or Q
        self.block_batch = block_batch if exact else None  # exact forwards run this many sequences' blocks (None: live)
        self.reserved = tuple(reserved.tolist()) if reserved is not None else ()  # the drafter's own cache slots
        self.device = model.embed.weight.device
        self.dev = devices.of(dev or self.device)  # the device's layout and speed (devices.py)
        self.sampler, self.prompt = sampler or Sampler(), prompt
        self.cache_row = cache_row  # this sequence's cache row
        self.cache_rows = None if cache.kv.shape[2] == 1 else torch.tensor([cache_row])  # as a forward takes it
        self.out: list[int] = []   # tokens emitted so far
        self.root = prompt[-1]     # the root of the next tree: emitted, not yet in the cache
        self.cur = 0               # committed slots 0..cur-1 hold the sequence before `root`
        self.forward_s = 0.0       # time from a step's launch to its read-back (in a batch, its share)
        self.cands = self.lists = None  # the next candidates its last accepted node drafted, (D, R) and as lists
        self.programs = programs or (programs_of(self.dev) if exact else None)  # how its programs run (None: eagerly)

    @property
    def room(self) -> int:  # rows the next forward may write: slots cur..capacity-1
        return self.cache.capacity - self.cur

    def fit(self, drafter: Drafter, tree: Tree, budget=None) -> tuple[Drafter, Tree]:
        """The tree trimmed to the cache's room; with no room even for the root's own rows, an AR step."""
        m = len(tree)
        while m > 1 and drafter.rows(m, budget) > self.room:
            m -= 1
        return (AR, tree.prefix(1)) if drafter.rows(m, budget) > self.room else (drafter, tree.prefix(m))

    def prepare(self, drafter: Drafter, tree: Tree, largest: int, budget=None) -> tuple[Block, Nodes]:
        """A step's rows and nodes, on the host, laid out for its cohort's largest tree: the tree's rows at the current
        position, filler nodes up to largest (token 0, children of the root, never verified: a batch's trees share one
        layout), then the groups of rows the drafter asks for (tree.Groups), laid out once per shape at position 0
        (tree.step_rows) and moved to cur; exact mode pads rows and nodes to Q."""
        n, groups, cur = len(tree), drafter.groups(tree, largest, budget), self.cur
        b, moves = step_rows(tree.parents + (0,) * (largest - n), groups, self.reserved, self.cache.capacity, None)
        tokens, real = torch.as_tensor(tree.tokens, device=HOST), torch.ones(n, dtype=torch.bool)
        ids = F.pad(tokens, (0, len(b) - n))
        if groups.tokens:  # the group rows' own ids (else 0: the forward embeds them)
            ids[largest:largest + len(groups.tokens)] = torch.as_tensor(groups.tokens)
        extra = torch.where(moves, b.extra + cur, b.extra)
        block = Block(ids[None], b.pos + cur, b.slots + cur, b.committed + cur, extra)
        # rows write slots cur..cur+len-1: past the capacity lie the reserved slots and the trash slot
        assert len(block) <= self.room, f"a step of {len(block)} rows overruns the cache ({self.room} slots left)"
        lay = Layout.of(tree.parents)
        if self.exact:
            if lay.anc.shape[-1] > self.tail:  # its deepest row's keys would not all be gathered in canonical order
                raise NanospecError(f"a path of {lay.anc.shape[-1]} nodes exceeds exact mode's tail of {self.tail} "
                                    f"keys ({drafter.name}'s max_depth is {drafter.max_depth})")
            block, lay = self.fixed(block), lay.pad(self.Q)
            tokens, real = F.pad(tokens, (0, self.Q - n), value=-1), F.pad(real, (0, self.Q - n))
        return block, Nodes(tokens, lay, real, largest, groups.M)

    def fixed(self, block: Block) -> Block:
        """An exact-mode block at fixed shapes, the same every step: Q rows, each seeing up to the cache's S slots."""
        if len(block) > self.Q:
            raise NanospecError(f"a step of {len(block)} rows exceeds the exact-mode block of Q={self.Q} rows; "
                                "raise --block")
        return block.pad(self.Q, self.cache.trash, self.cache.n_slots)

    def run(self, block: Block, embeds=None) -> torch.Tensor:
        """A forward without verification (prefill, BiTA's shallow prompt rows): the block's rows' logits."""
        n = len(block)
        if int(block.slots.max()) >= self.cache.trash:  # the sequence's slots, then the drafter's reserved ones
            raise NanospecError(f"a step of {n} rows does not fit the cache at {self.cur} tokens")
        block = self.fixed(block) if self.exact else block
        if embeds is not None and self.exact:
            embeds = F.pad(embeds, (0, 0, 0, self.Q - n))
        cache_rows, b = self.cache_rows, 0  # b: its sequence in the batch
        if self.block_batch:  # the block batch's sequences' blocks, this one's at its cache row
            padding = Nodes.idle(self.Q, self.cache.trash, self.cache.n_slots)
            (block, _, cache_rows), b = stack([self], [block], [padding[1]]), self.cache_row
            embeds = None if embeds is None else F.pad(embeds, (0, 0, 0, 0, b, self.block_batch - 1 - b))
        flat, spec = packed([block.tokens, block.pos, block.slots, block.committed, block.extra, cache_rows])

        def run(flat, embeds):
            *blk, cache_rows = unpacked(flat, spec)
            f = Forward.on_cache(self.model, Block(*blk), self.cache, self.exact, cache_rows, self.tail, self.dev)
            x = f.embed() if embeds is None else embeds
            return f.logits(f.norm(f.layers(x)), len(f.block))
        return self.launch(("run", spec), run, (flat, embeds))[b, :n]

    def launch(self, key, fn, args):  # fn(*args) on the device: eagerly, or as the generation's Programs run it
        if self.programs is None:
            return fn(*(None if a is None else a.to(self.device) for a in args))
        return self.programs.run(self.cache, key, fn, args, self.device)

    def prefill(self, tokens: list[int]) -> None:
        """Commit tokens in chunks (Q rows in exact mode: the same for every method)."""
        chunk = self.Q if self.exact else PREFILL_CHUNK_FAST
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            self.run(Tree.chain(part[0], part[1:]).block(self.cur))
            self.cur += len(part)

    def advance(self, path: list[int], tokens: list[int], cands, lists, forward_s: float) -> None:
        """A step's outcome: the accepted path's tokens emitted, the cursor past its keys (KVCache.commit moved them
        to cur, ...), the next candidates its end drafted, and its share of the step program's time."""
        self.cur, self.root, self.cands, self.lists = self.cur + len(path), tokens[-1], cands, lists
        self.out += tokens
        self.forward_s += forward_s


def stack(decs: list[Decoding], blocks: list[Block], nodes: list[Nodes]) -> tuple[Block, Nodes, torch.Tensor | None]:
    """A cohort's rows and nodes as one batch, on the host (Block.stack, Nodes.stack), and its cache rows (None: the
    cache's own order). With a block batch, every cache row's sequence, in order: the cohort's, and idle ones."""
    d, n, M = decs[0], nodes[0].largest, nodes[0].M  # every sequence's tree laid out for the cohort's largest
    if d.block_batch:
        own, idle = dict(zip((x.cache_row for x in decs), zip(blocks, nodes))), (d.Q, d.cache.trash, d.cache.n_slots)
        blocks, nodes = zip(*(own.get(r) or Nodes.idle(*idle) for r in range(d.block_batch)))
    elif len(decs) == 1:
        x = nodes[0]
        return blocks[0], Nodes(x.tokens[None], x.lay.batched(), x.real[None], n, M), d.cache_rows
    cache_rows = list(range(d.block_batch)) if d.block_batch else [x.cache_row for x in decs]  # block batch: 0, 1, ...
    in_order = cache_rows == list(range(d.cache.kv.shape[2]))
    return Block.stack(blocks, d.cache.trash), Nodes.stack(nodes, n, M), None if in_order else torch.tensor(cache_rows)


@dataclass
class Output:
    tokens: list[int]
    stop: str                   # "eos", "max_new_tokens" or "cache_full"
    steps: int = 0
    step_lengths: list[int] = field(default_factory=list)  # tokens emitted per step
    ar_steps: list[tuple[int, float]] = field(default_factory=list)  # each AR step's sequences and seconds
    forward_s: float = 0.0      # time in the steps' forwards (device-synchronised)
    prefill_s: float = 0.0      # the call's: every prompt's, in a batch
    decode_s: float = 0.0       # from its first step to its stop, prefills left out (in a batch, beside others)
    logits: torch.Tensor | None = None  # (new tokens, V) fp32: the logits each token came from

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.decode_s, 1e-9)


@torch.inference_mode()
def generate(model, prompt, drafter: Drafter | None = None, *, max_new_tokens=128, exact=False, Q=None, n_slots=None,
             tail=None, temperature=0.0, top_k=0, top_p=1.0, seed=0, eos_id=None, record_logits=False, batch=None,
             block_batch=None, compile=False, dev=None, programs=None, on_step=None):
    """Decode max_new_tokens after prompt (token ids) with a drafter (None: AR): an Output. A list of prompts is a
    batch: one Output each, every sequence as if decoded alone (its own sampling stream from seed). batch: the
    sequences decoded at once (None: all); a stopped one's cache row takes the next prompt (continuous batching).
    Q, n_slots, tail: exact mode's shapes (default: sizes.shapes); block_batch: its sequences' blocks per forward
    (default: sizes.block_batch); eos_id None: the model's, -1: none. dev: the device's layout and speed (default:
    devices.of the model's device); compile: exact mode's layer compiled (compiled.py); programs: how the device
    programs run (default: programs.of the device in exact mode). on_step(dec, step): each sequence's Step."""
    drafter = drafter or AR
    dev = devices.of(dev or model.embed.weight)
    if compile and not exact:
        raise NanospecError("compile=True needs exact=True")
    dev = replace(dev, call=compiled.layer) if compile else dev
    programs = programs or (programs_of(dev) if exact else None)
    many = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], (list, tuple))
    prompts = [check_prompt(p, model.args.vocab_size) for p in (prompt if many else [prompt])]
    Q, S, W = shapes([drafter], max(map(len, prompts)), max_new_tokens, Q, n_slots, tail)
    eos = model.args.eos_id if eos_id is None else eos_id
    batch = min(batch or len(prompts), len(prompts))
    block_batch, w = sizes.block_batch(block_batch, batch, exact, dev), model.embed.weight
    make = lambda: KVCache.for_model(model, S, block_batch or batch, dev)
    cache = programs.cache(model, (S, block_batch or batch, w.dtype, w.device), make) if programs else make()
    reserved = cache.reserve(drafter.reserved_slots)
    check_room(max(map(len, prompts)), cache.capacity)
    waiting, outs, logits, began, prefill_s = iter(prompts), {}, {}, {}, 0.0
    clock = lambda: time.perf_counter() - prefill_s  # decoding time: prefills, even of refilled rows, left out

    def admit(cache_row: int) -> list[Decoding]:
        """The next prompt, if any, into cache row cache_row: prefilled, and the drafter started on it."""
        nonlocal prefill_s
        p, t = next(waiting, None), time.perf_counter()
        if p is None:
            return []
        d = Decoding(model, cache, exact, Q, p, reserved, cache_row=cache_row, block_batch=block_batch, dev=dev, tail=W,
                     programs=programs, sampler=Sampler(temperature, top_k, top_p, seed, n=max_new_tokens + Q + 1))
        d.prefill(p[:-1])
        drafter.start(d)
        d.dev.sync(d.device)
        outs[d], logits[d], prefill_s = Output([], "max_new_tokens"), [], prefill_s + time.perf_counter() - t
        began[d] = clock()
        return [d]

    live = [d for r in range(batch) for d in admit(r)]
    if (planner := drafter.planner) is not None:
        planner.start(drafter, live[0])
    while live:
        ts = time.perf_counter()
        budget, results, rows = step(live, drafter, record_logits)
        secs, done = time.perf_counter() - ts, []
        for i, d in enumerate(live):
            r, toks = results[d], results[d].tokens
            if on_step is not None:
                on_step(d, r)
            if planner is not None:  # the step's rows and time once; each sequence's outcome
                planner.observe(d, budget, rows if i == 0 else 0, secs, r.path, r.whole, d.lists)
            logits[d].append(r.logits)  # None unless record_logits
            outs[d].steps += 1
            outs[d].step_lengths.append(len(toks))
            if budget == 0 or drafter.is_ar:  # an AR step: the planner's (a budget of 0), or AR's own
                outs[d].ar_steps.append((len(live), secs))
            stop = "eos" if eos in toks else "max_new_tokens" if len(d.out) >= max_new_tokens else \
                "cache_full" if d.room < 1 else None
            if stop:
                outs[d].stop, outs[d].decode_s = stop, clock() - began[d]
                done.append(d)
                drafter.finish(d)
        # a stopped sequence's refill takes its place: cache-row order, so a full batch reads the cache in place
        live = [n for d in live for n in (admit(d.cache_row) if d in done else [d])]
    for d, r in outs.items():
        r.prefill_s, r.forward_s = prefill_s, d.forward_s
        n = min(len(d.out), max_new_tokens)
        if eos in d.out[:n]:
            n, r.stop = d.out.index(eos) + 1, "eos"
        elif r.stop == "eos":  # the EOS came after the last token asked for
            r.stop = "max_new_tokens"
        r.tokens, r.logits = d.out[:n], torch.cat(logits[d])[:n] if record_logits else None
    return list(outs.values()) if many else outs[next(iter(outs))]
