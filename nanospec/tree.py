"""Draft trees: build, lay out as rows, choose a shape (verify.py verifies them).

A tree's node 0 is the root: the last emitted token, whose key/value is not in the cache yet.
Every other node is a draft token; parents[i] < i. Plain AR decoding is the tree with the root
alone. A tree of n nodes becomes n rows at cache slots cur..cur+n-1, node i at position
cur + depth(i), each seeing the committed slots 0..cur-1 and then its ancestors by depth and
itself: the canonical key order.

A tree's shape is laid out once (`Layout.of`, cached). A Template (Medusa's sparse tree of
candidate ranks) fills a fixed shape from the candidates the last step drafted, which that step's
read-back brought to the host with its accepted path.
"""
import functools
import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import Block


class Tree:
    def __init__(self, tokens, parents, matched: int = 0):
        """tokens: a list of ids or a 1-d tensor (left where it is); parents[i] < i, parents[0] = -1. matched: how
        many of the context's last tokens the drafts were retrieved by (Lookahead's trie), for a reader (show.py)."""
        assert len(tokens) == len(parents) and parents[0] == -1
        self.tokens, self.parents, self.matched = tokens, tuple(parents), matched

    def __len__(self):
        return len(self.parents)

    @classmethod
    def chain(cls, root: int, drafts=()) -> "Tree":
        return cls([root, *drafts], range(-1, len(drafts)))

    def token_list(self) -> list[int]:
        return self.tokens.tolist() if torch.is_tensor(self.tokens) else list(self.tokens)

    def prefix(self, m: int) -> "Tree":
        """The first m nodes: still a tree, since parents come first (the engine trims to the room left)."""
        return self if m == len(self) else Tree(self.tokens[:m], self.parents[:m], self.matched)

    def follow(self, truth: list[int]) -> list[int] | None:
        """The nodes (root first) that truth, the tokens after the root, runs through (None: truth is
        too short to tell): what a tree would have accepted, scored on the host once the output is known."""
        path = [0]
        for t in truth:
            nxt = next((i for i, p in enumerate(self.parents) if p == path[-1] and self.tokens[i] == t), None)
            if nxt is None:
                return path
            path.append(nxt)
        return None if path[-1] in self.parents else path

    def block(self, cur: int, device=None) -> Block:
        """Rows for this tree at committed length cur: node i writes slot cur+i."""
        lay = Layout.of(self.parents, device)
        tokens = self.tokens if torch.is_tensor(self.tokens) else torch.tensor(self.tokens)
        n = len(self)
        return Block(tokens.to(lay.anc.device).view(1, n), (lay.depth + cur)[None], lay.index + cur,
                     torch.full((1, n), cur, device=lay.anc.device),
                     torch.where(lay.anc < 0, -1, lay.anc + cur)[None])


@dataclass(frozen=True)
class Groups:
    """A step's rows after its tree, as a drafter asks for them (Drafter.groups): a group of M rows after each host
    node (group_rows: BiTA's mask tokens, Hidden Transfer's pseudo states, SDSAT's adaptive tokens)."""
    hosts: tuple = ()            # the tree nodes that carry a group
    M: int = 0                   # rows per group (0: none, the tree alone)
    sees_reserved: bool = False  # the groups also see the drafter's reserved slots (BiTA's prompt keys)
    chained: bool = True         # a group's row i sees its rows 0..i (False: itself only)
    tokens: tuple = ()           # the group rows' ids (a fine-tuned model's adaptive ids); none: 0, embedded apart


@functools.lru_cache(maxsize=4096)
def step_rows(parents: tuple, groups: Groups, reserved: tuple, capacity: int, device):
    """A step's rows at position 0, built once per shape (Decoding.prepare moves them to the current
    position): the tree's rows, then its groups (group_rows), which also see the reserved slots if
    asked. moves marks the visible slots that move with the position (the sequence's; reserved slots
    stay where they are)."""
    b = Tree([0] * len(parents), parents).block(0, device)
    if groups.M:
        seen = torch.tensor(reserved, dtype=torch.long) if groups.sees_reserved and reserved else None
        b = Block.cat(b, group_rows(b, list(groups.hosts), groups.M, seen, groups.chained))
    return b, (b.extra >= 0) & (b.extra < capacity)


@dataclass
class Nodes:
    """A step's trees as the forward sees them, on the device: one per sequence of the batch, padded to N nodes (Q in
    exact mode), then groups of M rows (Groups) from row `largest` for every sequence (a smaller tree's rows up to
    largest are filler: Decoding.prepare)."""
    tokens: torch.Tensor  # (B, N) -1 for padding (one sequence's alone: (N,))
    lay: "Layout"         # each field with the batch dim first
    real: torch.Tensor    # (B, N) bool
    largest: int          # the largest tree's nodes
    M: int = 0            # rows per group after the trees (Groups.M)

    @property
    def N(self) -> int:
        return self.tokens.shape[-1]

    @staticmethod
    def stack(nodes: list["Nodes"], largest: int, M: int) -> "Nodes":
        """Sequences' nodes as one batch, each padded to the most nodes (token -1, not real); largest, M: the step's."""
        N = max(x.N for x in nodes)
        pad = lambda t, v: torch.stack([F.pad(x, (0, N - len(x)), value=v) for x in t])
        return Nodes(pad([x.tokens for x in nodes], -1), Layout.stack([x.lay for x in nodes], N),
                     pad([x.real for x in nodes], False), largest, M)

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def idle(Q: int, trash: int, n_slots: int, device=None) -> tuple[Block, "Nodes"]:
        """An idle sequence's block and nodes in exact mode's block batch, made once: Q padding rows (they write and
        read the trash slot of their cache row) and a tree of no real node; read-only."""
        z, none = torch.zeros(1, Q, dtype=torch.long, device=device), torch.zeros(Q, dtype=torch.bool, device=device)
        slots = torch.full((Q,), trash, device=device)
        extra = F.pad(slots.view(1, Q, 1), (0, n_slots - 1), value=-1)
        return Block(z, z, slots, z, extra), Nodes(z[0] - 1, Layout.of((-1,), device).pad(Q), none, 1)


@dataclass(frozen=True)
class Layout:
    """A tree shape as tensors: each node's parent, depth, index and ancestors (its path from the
    root, -1 padded: anc (n, E))."""
    parent: torch.Tensor
    depth: torch.Tensor
    index: torch.Tensor
    anc: torch.Tensor

    @staticmethod
    def stack(lays: list["Layout"], N: int) -> "Layout":
        """A batch of layouts (batch dim first), each padded to N nodes."""
        lays = [x.pad(N) for x in lays]
        return Layout(*(torch.stack([getattr(x, f) for x in lays]) for f in ("parent", "depth", "index", "anc")))

    @staticmethod
    @functools.lru_cache(maxsize=512)
    def of(parents: tuple[int, ...], device=None) -> "Layout":
        """The layout of a tree shape, built once per shape and device (Medusa's static trees: once)."""
        n = len(parents)
        paths = [[]] * n
        for i, p in enumerate(parents):
            paths[i] = (paths[p] if p >= 0 else []) + [i]
        E = max(map(len, paths))
        anc = torch.tensor([p + [-1] * (E - len(p)) for p in paths])
        lay = Layout(torch.tensor(parents), torch.tensor([len(p) - 1 for p in paths]), torch.arange(n), anc)
        return Layout(*(t.to(device) for t in (lay.parent, lay.depth, lay.index, lay.anc))) if device else lay

    def batched(self) -> "Layout":
        """The layout as a batch of one."""
        return Layout(*(t[None] for t in (self.parent, self.depth, self.index, self.anc)))

    def pad(self, N: int) -> "Layout":
        """N nodes with paths of up to N (fixed shapes for exact mode): the extra nodes are padding
        (parent 0, no ancestors); verification tells them apart by their token -1."""
        n, E = self.anc.shape
        z = self.parent.new_zeros(N - n)
        anc = F.pad(self.anc, (0, N - E, 0, N - n), value=-1)
        return Layout(torch.cat([self.parent, z]), torch.cat([self.depth, z]), torch.arange(N, device=z.device), anc)


# --- shapes from candidate ranks -------------------------------------------------------------------

def choose_tree(acc: list[list[float]], size: int, allowed=None) -> list[tuple[int, ...]]:
    """Rank paths (r_1, ..., r_d), parents first: the `size` most probable under acc[d][r], the
    chance that depth d+1's rank-r candidate is right (Medusa's sparse tree; ProPD's expansion).
    allowed: the paths a method's trees may use (Drafter.allowed_paths), None for any.

    Best-first search. A path's children are pushed one at a time, most probable first: popping a
    node pushes its best child and its next sibling, so the heap holds about two entries per pop
    instead of R. Equally probable paths may come out in another order than a full expansion's."""
    K = len(acc)
    ok = (lambda p: True) if allowed is None else set(map(tuple, allowed)).__contains__
    order = [sorted(range(len(row)), key=lambda r: -row[r]) for row in acc]  # ranks, most probable first

    def push(heap, parent_p, parent, j):  # the j-th most probable allowed child of parent, if any
        d = len(parent)
        while j < len(order[d]) and not ok(parent + (order[d][j],)):
            j += 1
        if j < len(order[d]):
            r = order[d][j]
            heapq.heappush(heap, (-parent_p * acc[d][r], parent + (r,), parent_p, j))

    heap, paths = [], []
    push(heap, 1.0, (), 0)
    while heap and len(paths) < size:
        p, path, parent_p, j = heapq.heappop(heap)
        paths.append(path)
        push(heap, parent_p, path[:-1], j + 1)
        if len(path) < K:
            push(heap, -p, path, 0)
    return paths


class Template:
    """A fixed tree shape over ranked candidates: path (r_1, ..., r_d) is the branch cands[0][r_1],
    ..., cands[d-1][r_d]. Laid out once; each step only gathers the tokens."""

    def __init__(self, paths):
        self.paths = [tuple(p) for p in paths]
        index = {(): 0}
        for p in self.paths:
            assert p[:-1] in index, "paths must be prefix-closed, parents first"
            index[p] = len(index)
        self.parents = (-1, *(index[p[:-1]] for p in self.paths))
        self.depths = torch.tensor([len(p) - 1 for p in self.paths], dtype=torch.long)
        self.ranks = torch.tensor([p[-1] for p in self.paths], dtype=torch.long)
        self.depth = max(map(len, self.paths), default=0)
        self.topk = [1 + max(p[d] for p in self.paths if len(p) > d) for d in range(self.depth)]

    def __len__(self):
        return len(self.parents)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(paths: tuple) -> "Template":
        """One Template per tree shape, built once (the planner's trees)."""
        return Template(paths)

    @functools.lru_cache(maxsize=64)
    def cut(self, depth: int) -> "Template":
        """The paths at most `depth` deep (when fewer depths were drafted)."""
        return self if depth >= self.depth else Template([p for p in self.paths if len(p) <= depth])

    def tree(self, root: int, cands: torch.Tensor) -> Tree:
        """The tree for candidates cands (D, R): ranked tokens per depth, on any device."""
        t = self.cut(len(cands))
        where = t.gather(cands.shape[1], cands.device)
        tokens = torch.cat([cands.new_tensor([root]), cands.flatten()]).index_select(0, where)
        return Tree(tokens, t.parents)

    @functools.lru_cache(maxsize=8)
    def gather(self, R: int, device) -> torch.Tensor:
        """Where each node's token sits in [root, cands (D, R) flattened]: built once per R and device."""
        return torch.cat([torch.zeros(1, dtype=torch.long), 1 + self.depths * R + self.ranks]).to(device)


def product_paths(widths: list[int]) -> list[tuple[int, ...]]:
    """Every combination of ranks, depth by depth: the full tree over widths[d] candidates per depth."""
    paths = [()]
    out = []
    for w in widths:
        paths = [p + (r,) for p in paths for r in range(w)]
        out += paths
    return sorted(out, key=len)


@functools.lru_cache(maxsize=512)
def chain_end(parents: tuple) -> int:
    """The end of a tree's top-1 chain: the lowest-index child at every depth (a template puts rank 0 first)."""
    h = 0
    while h + 1 < len(parents) and h in parents[h + 1:]:
        h = parents.index(h, h + 1)
    return h


def group_row_index(n: int, H: int, M: int, device=None) -> torch.Tensor:
    """(M, H): the row of host h's group row i in a step's block (group_rows' layout: after the n tree rows, host by
    host)."""
    return n + torch.arange(H * M, device=device).view(H, M).t()


def group_rows(blk: Block, hosts: list[int], M: int, reserved=None, chained: bool = True) -> Block:
    """A group of M rows after each host node of a tree block (BiTA's mask tokens, Hidden
    Transfer's pseudo states, SDSAT's adaptive tokens): row i of a host at position p sits at
    p+1+i, writes the slot after the block's + (group * M + i) and sees the reserved slots, the
    host's path and its group's rows 0..i (chained=False: itself only). No tree row sees them."""
    device = blk.slots.device
    H = len(hosts)
    h = torch.tensor(hosts, device=device)
    i = torch.arange(M, device=device)
    pos = (blk.pos[0, h][:, None] + 1 + i).reshape(1, H * M)
    slots = blk.slots[-1:] + 1 + torch.arange(H * M, device=device)  # on the device: no host read (group_row_index's)
    group = slots.view(H, 1, M).expand(H, M, M)
    sees = i[None, None] <= i[None, :, None] if chained else i[None, None] == i[None, :, None]
    group = torch.where(sees, group, -1)
    path = blk.extra[0, h][:, None].expand(H, M, -1)
    parts = [path, group]
    if reserved is not None and len(reserved):
        parts.insert(0, reserved.to(device).view(1, 1, -1).expand(H, M, -1))
    extra = torch.cat(parts, -1).reshape(1, H * M, -1)
    committed = blk.committed[:, :1].expand(1, H * M)
    return Block(torch.zeros(1, H * M, dtype=torch.long, device=device), pos, slots, committed, extra)
