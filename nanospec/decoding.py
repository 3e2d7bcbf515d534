"""One sequence's generation (Decoding): its state, handed to its drafter at every step, and its own part of a step.

A Decoding lays out its step's rows and nodes (prepare: the drafter's rows, through Decoding.block), runs forwards
outside a step (prefill, a method's reserved keys) and commits an accepted path; `stack` joins a group's rows and
nodes into one batch. The engine (engine.py) runs the steps, every live sequence's at once.
"""
import torch
import torch.nn.functional as F

from . import NanospecError, devices
from .block import Block
from .cache import KVCache
from .devices import Device
from .drafter import AR, Drafter, Forward, Nodes, idle, ones
from .programs import EAGER, packed, unpacked
from .tree import Sampler, Tree, layout, step_layout

PREFILL_CHUNK_FAST = 256  # fast mode has no block shape to keep; chunks only bound memory
HOST = torch.device("cpu")  # where a step is drafted and laid out


class Decoding:
    """The state of one sequence's generation, handed to its drafter at every step. A batch is a
    Decoding per sequence on one cache, each with its own cache row (seq) and cursor (cur)."""

    def __init__(self, model, cache: KVCache, exact: bool, Q: int, prompt: list[int], reserved=None,
                 sampler: Sampler | None = None, seq: int = 0, block_batch: int | None = None,
                 dev: Device | None = None, tail: int | None = None, programs=None):
        self.model, self.cache, self.exact, self.Q = model, cache, exact, Q
        self.tail = tail or Q      # exact mode: the keys each row gathers in canonical order (sizes.shapes' W)
        self.N = block_batch if exact else None  # exact forwards run N sequences' blocks (None: the live ones)
        self.reserved = reserved   # the drafter's own cache slots (e.g. BiTA's prompt keys)
        self.device = model.embed.weight.device
        self.dev = devices.of(dev or self.device)  # the device's layout and speed (devices.py)
        self.sampler = sampler or Sampler()
        self.prompt = prompt
        self.seq = seq             # this sequence's cache row
        self.seqs = None if cache.k.shape[1] == 1 else torch.tensor([seq])
        self.out: list[int] = []   # tokens emitted so far
        self.last = prompt[-1]     # the root of the next tree: emitted, not yet in the cache
        self.cur = 0               # committed slots 0..cur-1 hold the sequence before `last`
        self.forward_s = 0.0       # time from a step's launch to its read-back (in a batch, its share)
        self.cands = self.lists = None  # the next candidates its last accepted node drafted, (D, R) and as lists
        self.reserved_slots = tuple(reserved.tolist()) if reserved is not None else ()
        self.programs = programs or (self.dev.programs if exact else EAGER)  # how its device programs run

    def block(self, tree: Tree, hosts=(), M: int = 0, reserved: bool = False, chained: bool = True, n=0) -> Block:
        """The tree's rows at the current position, on the host, then filler nodes up to n (token 0,
        children of the root, never verified: a batch's trees share one layout), then (M > 0) a group
        of M rows after each host node (tree.group_rows; reserved: they also see the drafter's reserved
        slots). Laid out once per shape at position 0 (tree.step_layout) and moved to cur."""
        parents = tree.parents + (0,) * (n - len(tree))
        b, seq = step_layout(parents, tuple(hosts), M, self.reserved_slots if reserved else (), chained,
                             self.cache.capacity, None)
        tokens, cur = F.pad(torch.as_tensor(tree.tokens, device=HOST), (0, len(b) - len(tree))).view(1, -1), self.cur
        return Block(tokens, b.pos + cur, b.slots + cur, b.prefix + cur, torch.where(seq, b.extra + cur, b.extra))

    def keep(self, keys=None, values=None, embeds=None) -> None:
        """Fill the drafter's reserved cache slots: with per-layer keys and values as given, or with
        those that rows of embeds compute, causal among themselves from position 0 (BiTA's deep and
        shallow prompts)."""
        slots, s = self.reserved, self.seq
        if embeds is None:
            for i, kv in enumerate(zip(keys, values)):
                for c, x in zip(self.cache.layer(i), kv):
                    c[s:s + 1, :, slots.to(c.device), :x.shape[-1]] = x  # a cache's head width may be padded
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
        """A step's rows and nodes, on the host, laid out for its group's largest tree; exact mode pads both to Q."""
        n = len(tree)
        tokens, real = torch.as_tensor(tree.tokens, device=HOST), ones(n, HOST)
        block = drafter.rows(self, Tree(tokens, tree.parents), largest)
        # rows write slots cur..cur+len-1: past the capacity lie the reserved slots and the trash slot
        assert len(block) <= self.room, f"a step of {len(block)} rows overruns the cache ({self.room} slots left)"
        lay = layout(tree.parents)
        if self.exact:
            if lay.anc.shape[-1] > self.tail:  # its deepest row's keys would not all be gathered in canonical order
                raise NanospecError(f"a path of {lay.anc.shape[-1]} nodes exceeds exact mode's tail of {self.tail} "
                                    f"keys ({drafter.name}'s max_depth is {drafter.max_depth})")
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
        model, cache, exact, tail = self.model, self.cache, self.exact, self.tail
        block = self.fixed(block) if exact else block
        if embeds is not None and exact:
            embeds = F.pad(embeds, (0, 0, 0, self.Q - n))
        seqs, at = self.seqs, 0
        if self.N:  # N sequences' blocks, this one's at its cache row
            (block, _, seqs), at = stack([self], [block], [self.idle()[1]]), self.seq
            embeds = None if embeds is None else F.pad(embeds, (0, 0, 0, 0, at, self.N - 1 - at))
        flat, spec = packed([block.tokens, block.pos, block.slots, block.prefix, block.extra, seqs])

        def run(flat, embeds):
            *b, seqs = unpacked(flat, spec)
            f = Forward.on_cache(model, Block(*b), cache, exact, seqs, tail, self.dev)
            x = f.embed() if embeds is None else embeds
            return f.logits(f.norm(f.layers(x)), len(f.block))
        return self.launch(("run", spec), run, (flat, embeds))[at, :n]

    def idle(self) -> tuple[Block, Nodes]:  # a padding sequence's block and nodes (drafter.idle)
        return idle(self.Q, self.cache.trash, self.cache.n_slots, HOST)

    def launch(self, key, fn, args):  # fn(*args) on the device, as the generation's Programs run it
        return self.programs.run(self.cache, key, fn, args, self.device)

    def prefill(self, tokens: list[int]) -> None:
        """Commit tokens in chunks (Q rows in exact mode: the same for every method)."""
        chunk = self.Q if self.exact else PREFILL_CHUNK_FAST
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            self.run(Tree.chain(part[0], part[1:]).block(self.cur))
            self.cur += len(part)

    def commit(self, path: list[int], tokens: list[int], moved: bool = True) -> None:
        """The accepted path's tokens emitted and its keys kept: node i sits at slot cur+i, and its
        entries move to cur, cur+1, ... (moved: the step's program did it already, as greedy steps do)."""
        if not moved:
            self.cache.compact([self.cur + i for i in path], self.cur, self.seq)
        self.cur += len(path)
        self.out += tokens
        self.last = tokens[-1]

    def sync(self):
        self.dev.sync(self.device)


def stack(decs: list[Decoding], blocks: list[Block], nodes: list[Nodes]) -> tuple[Block, Nodes, torch.Tensor | None]:
    """A group's rows and nodes as one batch, on the host (Block.stack, Nodes.stack), and its cache rows (None: the
    cache's own order). With a block batch of N, every cache row's sequence, in order: the group's, and idle ones."""
    d, n = decs[0], nodes[0].n  # every sequence's tree laid out for the group's largest
    if d.N:
        own, padding = dict(zip((x.seq for x in decs), zip(blocks, nodes))), d.idle()
        blocks, nodes = zip(*(own.get(r, padding) for r in range(d.N)))
    elif len(decs) == 1:
        x = nodes[0]
        return blocks[0], Nodes(x.tokens[None], x.lay.at(None), x.real[None], x.n), d.seqs
    seqs = list(range(d.N)) if d.N else [x.seq for x in decs]  # a block batch: every cache row, in order
    in_order = seqs == list(range(d.cache.k.shape[1]))
    return Block.stack(blocks, d.cache.trash), Nodes.stack(nodes, n), None if in_order else torch.tensor(seqs)
