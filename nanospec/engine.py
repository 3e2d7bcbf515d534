"""The decoding loop: prefill, then steps (step: draft -> lay out -> forward -> verify -> commit) until a stop.

A method is a Drafter (drafter.py: the contract, one hook per step of the paper). The core does the rest: it trims
a tree to the cache's room, pads exact-mode blocks, verifies on the device and takes the next candidates' top-k
there (greedy), all as one device program (a device layer may capture it: Programs), and reads back the accepted
path and the candidates once (tree.pack): one host-device sync per step.

In exact mode every forward runs Q rows per sequence on a cache of S slots: runs compared bitwise share Q and S
(sizes.shapes). With a block batch of N (sizes.block_batch), every exact forward runs N sequences' blocks, idle ones
padded, so a product's total rows (a library may pick its kernel by them) never change.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import NanospecError, sizes
from .cache import KVCache
from .drafter import AR, Drafter, Forward, Nodes, idle, ones
from .model import Block
from .sizes import check_prompt, check_room, shapes
from .tree import Layout, Sampler, Tree, accept, layout, pack, step_layout, unpack
from .tree import verify as tree_verify

PREFILL_CHUNK_FAST = 256  # fast mode has no block shape to keep; chunks only bound memory


class Programs:
    """How a generation's device programs (a step, a prefill chunk) run, and on which cache: as the Python
    they are, on a new cache each time. A device layer registered in PROGRAMS runs exact mode's otherwise
    on its device (tuning/cuda.py: CUDA graphs, bound to caches it keeps)."""

    def cache(self, model, n_slots: int, batch: int) -> KVCache:
        return KVCache.for_model(model, n_slots, batch)

    def run(self, cache: KVCache, key, fn, args, device):  # key: the program's name (a capture's, with the shapes)
        return fn(*(None if a is None else a.to(device) for a in args))


EAGER = Programs()
PROGRAMS: dict[str, Programs] = {}  # device type -> a device layer's Programs for exact mode
COMPILE = None  # compile=True: fn(model) compiling exact mode's layer (tuning/compiled.py registers it)


class Decoding:
    """The state of one sequence's generation, handed to its drafter at every step. A batch is a
    Decoding per sequence on one cache, each with its own cache row (seq) and cursor (cur)."""

    def __init__(self, model, cache: KVCache, exact: bool, Q: int, prompt: list[int], reserved=None,
                 sampler: Sampler | None = None, seq: int = 0, block_batch: int | None = None,
                 programs: Programs = EAGER):
        self.model, self.cache, self.exact, self.Q = model, cache, exact, Q
        self.N = block_batch if exact else None  # exact forwards run N sequences' blocks (None: the live ones)
        self.reserved = reserved   # the drafter's own cache slots (e.g. BiTA's prompt keys)
        self.device = model.embed.weight.device
        self.sampler = sampler or Sampler()
        self.prompt = prompt
        self.seq = seq             # this sequence's cache row
        self.seqs = None if cache.k.shape[1] == 1 else torch.tensor([seq], device=self.device)
        self.out: list[int] = []   # tokens emitted so far
        self.last = prompt[-1]     # the root of the next tree: emitted, not yet in the cache
        self.cur = 0               # committed slots 0..cur-1 hold the sequence before `last`
        self.forward_s = 0.0       # time in forwards (synchronised; in a batch, its share), for the benchmark
        self.cands = self.lists = None  # the next candidates its last accepted node drafted (step())
        self.reserved_slots = tuple(reserved.tolist()) if reserved is not None else ()
        self.cuda, self.programs = self.device.type == "cuda", programs

    def block(self, tree: Tree, hosts=(), M: int = 0, reserved: bool = False, chained: bool = True, n=0) -> Block:
        """The tree's rows at the current position, on the device, then filler nodes up to n (token 0,
        children of the root, never verified: a batch's trees share one layout), then (M > 0) a group
        of M rows after each host node (tree.group_rows; reserved: they also see the drafter's reserved
        slots). Laid out once per shape at position 0 (tree.step_layout) and moved to cur."""
        parents = tree.parents + (0,) * (n - len(tree))
        b, seq = step_layout(parents, tuple(hosts), M, self.reserved_slots if reserved else (), chained,
                             self.cache.capacity, self.device)
        tokens, cur = F.pad(self.tokens(tree), (0, len(b) - len(tree))).view(1, -1), self.cur
        return Block(tokens, b.pos + cur, b.slots + cur, b.prefix + cur, torch.where(seq, b.extra + cur, b.extra))

    def tokens(self, tree: Tree) -> torch.Tensor:  # on the device (drafted there already, or sent from the host)
        t = tree.tokens
        return t if torch.is_tensor(t) and t.device == self.device else torch.as_tensor(t, device=self.device)

    def keep(self, keys=None, values=None, embeds=None) -> None:
        """Fill the drafter's reserved cache slots: with per-layer keys and values as given, or with
        those that rows of embeds compute, causal among themselves from position 0 (BiTA's deep and
        shallow prompts)."""
        slots, s = self.reserved, self.seq
        if embeds is None:
            for i, kv in enumerate(zip(keys, values)):
                for c, x in zip(self.cache.layer(i), kv):
                    c[s:s + 1, :, slots] = x
            return
        P = len(slots)
        extra = torch.where(torch.arange(P)[None] <= torch.arange(P)[:, None], slots[None], -1)
        z = torch.zeros(1, P, dtype=torch.long)
        self.run(Block(z, torch.arange(P)[None], slots, z, extra[None]), embeds=embeds[None])

    @property
    def room(self) -> int:  # rows the next forward may write: slots cur..capacity-1
        return self.cache.capacity - self.cur

    def fit(self, drafter: Drafter, tree: Tree) -> tuple[Drafter, Tree]:
        """The tree trimmed to the cache's room; with no room even for the root's own rows, the step
        is plain AR (the method drafts nothing next)."""
        m = len(tree)
        while m > 1 and drafter.size(m) > self.room:
            m -= 1
        return (AR, tree.prefix(1)) if drafter.size(m) > self.room else (drafter, tree.prefix(m))

    def prepare(self, drafter: Drafter, tree: Tree, largest: int) -> tuple[Block, Nodes]:
        """A step's rows and nodes on the device, laid out for its group's largest tree; exact mode pads both to Q."""
        n = len(tree)
        tokens, real = self.tokens(tree), ones(n, self.device)
        block = drafter.rows(self, Tree(tokens, tree.parents), largest)  # the tokens go to the device once
        # rows write slots cur..cur+len-1: past the capacity lie the reserved slots and the trash slot
        assert len(block) <= self.room, f"a step of {len(block)} rows overruns the cache ({self.room} slots left)"
        lay = layout(tree.parents, self.device)
        if self.exact:
            block, lay = self.fixed(block), lay.pad(self.Q)
            tokens, real = F.pad(tokens, (0, self.Q - n), value=-1), F.pad(real, (0, self.Q - n))
        return block, Nodes(tokens, lay, real, largest)

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
        """A forward without verification (prefill, BiTA's shallow prompt rows): the block's rows' logits."""
        n = len(block)
        if int(block.slots.max()) >= self.cache.trash:  # the sequence's slots, then the drafter's reserved ones
            raise NanospecError(f"a step of {n} rows does not fit the cache at {self.cur} tokens")
        model, cache, exact = self.model, self.cache, self.exact
        block = self.fixed(block) if exact else block.to(self.device)
        if embeds is not None and exact:
            embeds = F.pad(embeds, (0, 0, 0, self.Q - n))

        def run(embeds, seqs, *b):
            f = Forward.on_cache(model, Block(*b), cache, exact, seqs)
            x = f.embed() if embeds is None else embeds
            return f.logits(f.norm(f.layers(x)), len(f.block))
        seqs, at = self.seqs, 0
        if self.N:  # N sequences' blocks, this one's at its cache row
            (block, _, seqs), at = stack([self], [block.to(self.device)], [self.idle()[1]]), self.seq
            embeds = None if embeds is None else F.pad(embeds, (0, 0, 0, 0, at, self.N - 1 - at))
        args = (embeds, seqs, block.tokens, block.pos, block.slots, block.prefix, block.extra)
        return self.launch(("run",), run, args)[at, :n]

    def idle(self) -> tuple[Block, Nodes]:  # a padding sequence's block and nodes (drafter.idle)
        return idle(self.Q, self.cache.trash, self.cache.n_slots, self.device)

    def launch(self, key, fn, args):  # fn(*args) on the device, as the generation's Programs run it
        return self.programs.run(self.cache, key, fn, args, self.device)

    def prefill(self, tokens: list[int]) -> None:
        """Commit tokens in chunks (Q rows in exact mode: the same for every method)."""
        chunk = self.Q if self.exact else PREFILL_CHUNK_FAST
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            self.run(Tree.chain(part[0], part[1:]).block(self.cur))
            self.cur += len(part)

    def commit(self, path: list[int], tokens: list[int]) -> None:
        """Keep the accepted path's keys (node i sits at slot cur+i) and emit its tokens."""
        self.cache.compact([self.cur + i for i in path], self.cur, self.seq)
        self.cur += len(path)
        self.out += tokens
        self.last = tokens[-1]

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


def stack(decs: list[Decoding], blocks: list[Block], nodes: list[Nodes]) -> tuple[Block, Nodes, torch.Tensor | None]:
    """A group's rows and nodes as one batch: each sequence padded to the group's longest (exact
    mode's are Q rows already). A fast-mode padding row writes the trash slot and sees slot 0 of its
    own sequence, so it widens no attention. Also the group's cache rows (None: the cache's own order).
    With a block batch of N, every cache row's sequence, in order: the group's, and idle ones."""
    d, n = decs[0], nodes[0].n  # every sequence's tree laid out for the group's largest
    if d.N:
        own, idle = dict(zip((x.seq for x in decs), zip(blocks, nodes))), d.idle()
        blocks, nodes = zip(*(own.get(r, idle) for r in range(d.N)))
    elif len(decs) == 1:
        x = nodes[0]
        return blocks[0], Nodes(x.tokens[None], x.lay.at(None), x.real[None], x.n), d.seqs
    T, N, E = max(map(len, blocks)), max(len(x.tokens) for x in nodes), max(b.extra.shape[-1] for b in blocks)
    dev, rows = d.device, []
    for b in blocks:
        if len(b) < T:  # exact mode's blocks are Q rows already
            z = torch.zeros(1, T - len(b), dtype=torch.long, device=dev)
            b = Block.cat(b, Block(z, z, torch.full((T - len(b),), d.cache.trash, device=dev), z + 1, z[..., None] - 1))
        extra = F.pad(b.extra, (0, E - b.extra.shape[-1]), value=-1)
        rows.append(Block(b.tokens, b.pos, b.slots[None], b.prefix, extra))
    block = Block(*(torch.cat([getattr(b, f) for b in rows]) for f in ("tokens", "pos", "slots", "prefix", "extra")))
    pad = lambda t, v: torch.stack([F.pad(x, (0, N - len(x)), value=v) for x in t])
    batch = Nodes(pad([x.tokens for x in nodes], -1), Layout.stack([x.lay for x in nodes], N),
                  pad([x.real for x in nodes], False), n)
    seqs = list(range(d.N)) if d.N else [x.seq for x in decs]  # a block batch: every cache row, in order
    return block, batch, None if seqs == list(range(d.cache.k.shape[1])) else torch.tensor(seqs, device=dev)


def program(d: Decoding, drafter: Drafter, block: Block, nodes: Nodes, seqs):
    """A step's device program for a group of sequences (batch dim first), and its seconds: the method's
    forward, then (greedy) each sequence's verification and next candidates' top-k, packed as rows of
    one tensor. Exact mode: fixed shapes, one program per method, shape key and group size (one CUDA
    graph each where a device layer captures them)."""
    model, cache, exact, greedy = d.model, d.cache, d.exact, d.sampler.greedy
    R = max(drafter.topk, default=1)

    def run(tokens, pos, slots, prefix, extra, seqs, node_tokens, parent, depth, index, anc, real):
        f = Forward.on_cache(model, Block(tokens, pos, slots, prefix, extra), cache, exact, seqs)
        lay = Layout(parent, depth, index, anc)
        out = drafter.forward(f, Nodes(node_tokens, lay, real, nodes.n))
        N = node_tokens.shape[-1]  # drafts may cover the real nodes only (a path ends on one): depths are padded
        if out.depths is not None and out.depths.shape[1] < N:
            out.depths = F.pad(out.depths, (0, N - out.depths.shape[1]))
        if not greedy:
            return out.logits, out.drafts, out.depths, out.alive
        path, emitted = accept(node_tokens, lay, out.logits, out.alive)  # (B, E) each
        if out.drafts is None:
            return pack(path, emitted), out.logits
        last = path.max(-1).values  # each path's deepest node (indices grow along a path)
        b = torch.arange(len(last), device=last.device)
        cands = drafter.propose(out.drafts[b, last]).topk(R, dim=-1).indices  # (B, K, R): one product for all
        depth = out.depths[b, last] if out.depths is not None else torch.full_like(last, cands.shape[1])
        return pack(path, emitted, depth, cands), out.logits
    lay = nodes.lay
    args = (*(block.tokens, block.pos, block.slots, block.prefix, block.extra), seqs,
            nodes.tokens, lay.parent, lay.depth, lay.index, lay.anc, nodes.real)
    key = ("step", id(drafter), drafter.shape_key(nodes) if exact else None, greedy)  # a capture keeps drafter alive
    d.sync()
    t0 = time.perf_counter()
    res = d.launch(key, run, args)
    d.sync()
    return res, time.perf_counter() - t0


def step(live: list[Decoding], drafter: Drafter, record: bool):
    """One step of every live sequence, in order: plan the budget, draft each tree, lay the trees out as
    rows, run the forward and verify on the device (one program per group of one drafter and layout),
    read the accepted paths back once, commit them. Returns the budget, per sequence (tree, path,
    emitted tokens, their logits if record, the whole draft) and the step's rows."""
    budget, template = drafter.planner.budget(live) if drafter.planner is not None else (None, None)
    stepper = drafter if budget != 0 else AR  # budget 0: drafting does not pay, an AR step
    wide = drafter.nested and budget is not None  # drafted whole, AR steps too: the planner scores every prefix
    groups, drafted, results, rows = {}, {}, {}, 0
    for d in live:  # draft
        drafted[d] = (drafter if wide else stepper).draft(
            d, d.cands, template or getattr(drafter, "template", None), None if wide else budget)
        s, tree = d.fit(stepper, drafted[d].prefix(min(len(drafted[d]), budget + 1)) if wide else drafted[d])
        key = (id(s), None if d.room >= s.max_rows else len(tree))  # near the cache's end: no filler
        groups.setdefault(key, (s, []))[1].append((d, tree))
    for s, members in groups.values():
        decs, trees = [m[0] for m in members], [m[1] for m in members]
        n = max(map(len, trees))  # lay out: one layout for the group, smaller trees get filler nodes
        block, nodes, seqs = stack(decs, *zip(*(x.prepare(s, t, n) for x, t in zip(decs, trees))))
        found = verify(decs, s, trees, program(decs[0], s, block, nodes, seqs), nodes, record)  # forward, verify
        for d, tree, (path, emitted, logits) in zip(decs, trees, found):  # commit
            d.commit(path, emitted)
            drafter.accepted(d, tree, path)
            results[d], rows = (tree, path, emitted, logits, drafted[d]), rows + s.size(len(tree))
    return budget, results, rows


def verify(decs: list[Decoding], drafter: Drafter, trees: list[Tree], launched, nodes: Nodes, record: bool):
    """A group's step program's results (launched: with its seconds) read back once: greedy, each sequence's
    path and next candidates, verified on the device; sampling verifies on the host. Per sequence: (path,
    emitted tokens, their logits if record); its next candidates go to cands (D, R) and lists."""
    d, (res, took) = decs[0], launched
    at = [x.seq for x in decs] if d.N else list(range(len(decs)))  # each sequence's index in the batch
    if d.sampler.greedy:
        packed, logits = res
        head = packed.tolist()  # the step's one read-back
    else:  # sampling verifies on the host: the logits are read back anyway
        logits, drafts, depths, alive = res
        found = [tree_verify(t, logits[b, :len(t)], x.sampler, len(x.out), None if alive is None else alive[b, :len(t)])
                 for b, x, t in zip(at, decs, trees)]
        if drafts is not None:  # each path's end drafts: one product for the batch, as greedy's
            ends = torch.tensor([path[-1] for path, _ in found], device=drafts.device)
            top = drafter.propose(drafts[torch.tensor(at, device=ends.device), ends])
            top = top.topk(max(drafter.topk), dim=-1).indices  # (B, K, R)
    results = []
    for b, x in enumerate(decs):
        x.forward_s += took / len(decs)  # its share of the step's forward
        if d.sampler.greedy:
            E = nodes.lay.anc.shape[-1]
            path, emitted, x.cands, x.lists = unpack(head[at[b]], packed[at[b]], E, max(drafter.topk, default=1))
        else:
            (path, emitted), x.cands, x.lists = found[b], None, None
            depth = 0 if drafts is None else int(depths[at[b], path[-1]]) if depths is not None else top.shape[1]
            if depth:
                x.cands, x.lists = top[b, :depth], top[b, :depth].tolist()
        results.append((path, emitted, logits[at[b], path].float().cpu() if record else None))
    return results


@dataclass
class Output:
    tokens: list[int]
    stop: str                   # "eos", "max_new_tokens" or "cache_full"
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per step
    forward_s: float = 0.0      # time in the steps' forwards (device-synchronised)
    prefill_s: float = 0.0      # the call's: every prompt's, in a batch
    decode_s: float = 0.0       # from its first step to its stop, prefills left out (in a batch, beside others)
    logits: torch.Tensor | None = None  # (new tokens, V) fp32: the logits each token came from

    @property
    def mean_accepted(self) -> float:
        return len(self.tokens) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.decode_s, 1e-9)


@torch.inference_mode()
def generate(model, prompt, drafter: Drafter | None = None, *, max_new_tokens=128, exact=False,
             Q=None, n_slots=None, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             eos_id=None, record_logits=False, batch=None, block_batch=None, compile=False):
    """Decode max_new_tokens after prompt (token ids) with a drafter (None: AR): an Output. A list of prompts is a
    batch: one Output each, every sequence as if decoded alone (its own sampling stream from seed). batch: the
    sequences decoded at once (None: all); a stopped one's cache row takes the next prompt (continuous batching).
    Q, n_slots: exact mode's block and cache size S (default: sizes.shapes); block_batch: its sequences' blocks
    per forward (default: sizes.block_batch); eos_id None: the model's, -1: none. compile: see tuning/compiled.py."""
    drafter = drafter or AR
    if compile:
        if not exact or COMPILE is None:
            raise NanospecError("compile=True needs exact=True, and nanospec.tuning.compiled imported (it registers)")
        COMPILE(model)
    many = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], (list, tuple))
    prompts = [check_prompt(p, model.args.vocab_size) for p in (prompt if many else [prompt])]
    Q, S = shapes([drafter], max(map(len, prompts)), max_new_tokens, Q, n_slots)
    eos = model.args.eos_id if eos_id is None else eos_id
    rows = min(batch or len(prompts), len(prompts))
    N = sizes.block_batch(block_batch, rows, exact, model.embed.weight.device)
    programs = PROGRAMS.get(model.embed.weight.device.type, EAGER) if exact else EAGER
    cache = programs.cache(model, S, N or rows)
    reserved = cache.reserve(drafter.reserved_slots)
    check_room(max(map(len, prompts)), cache.capacity)
    waiting, outs, logits, began, prefill_s = iter(prompts), {}, {}, {}, 0.0
    clock = lambda: time.perf_counter() - prefill_s  # decoding time: prefills, even of refilled rows, left out

    def admit(seq: int) -> list[Decoding]:
        """The next prompt, if any, into cache row seq: prefilled, and the drafter started on it."""
        nonlocal prefill_s
        p, t = next(waiting, None), time.perf_counter()
        if p is None:
            return []
        d = Decoding(model, cache, exact, Q, p, reserved, seq=seq, block_batch=N, programs=programs,  # a stream each
                     sampler=Sampler(temperature, top_k, top_p, seed, n=max_new_tokens + Q + 1))
        d.prefill(p[:-1])
        drafter.start(d)
        d.sync()
        outs[d], logits[d], prefill_s = Output([], "max_new_tokens"), [], prefill_s + time.perf_counter() - t
        began[d] = clock()
        return [d]

    live = [d for seq in range(rows) for d in admit(seq)]
    if (planner := drafter.planner) is not None:
        planner.start(drafter, live[0])
    while live:
        ts = time.perf_counter()
        budget, results, rows = step(live, drafter, record_logits)
        secs, done = time.perf_counter() - ts, []
        for i, d in enumerate(live):
            tree, path, toks, r, drafted = results[d]
            if planner is not None:  # the step's rows and time once; each sequence's outcome
                planner.observe(d, budget, rows if i == 0 else 0, secs, path, drafted, d.lists)
            logits[d].append(r)  # None unless record_logits
            outs[d].steps += 1
            outs[d].accepted.append(len(toks))
            stop = "eos" if eos in toks else "max_new_tokens" if len(d.out) >= max_new_tokens else \
                "cache_full" if d.room < 1 else None
            if stop:
                outs[d].stop, outs[d].decode_s = stop, clock() - began[d]
                done.append(d)
                drafter.finish(d)
        # a stopped sequence's refill takes its place: cache-row order, so a full batch reads the cache in place
        live = [n for d in live for n in (admit(d.seq) if d in done else [d])]
    for d, r in outs.items():
        r.prefill_s, r.forward_s = prefill_s, d.forward_s
        n = min(len(d.out), max_new_tokens)
        if eos in d.out[:n]:
            n, r.stop = d.out.index(eos) + 1, "eos"
        elif r.stop == "eos":  # the EOS came after the last token asked for
            r.stop = "max_new_tokens"
        r.tokens = d.out[:n]
        if record_logits:
            r.logits = torch.cat(logits[d])[:n]
    return list(outs.values()) if many else outs[next(iter(outs))]
