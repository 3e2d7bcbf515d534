"""Draft trees: build, flatten to rows, verify.

A tree's node 0 is the root: the last emitted token, whose key/value is not in
the cache yet. Every other node is a draft token; parents[i] < i. Plain AR
decoding is the tree with the root alone. A tree of n nodes becomes n rows at
cache slots cur..cur+n-1, node i at position cur + depth(i), each seeing the
committed prefix 0..cur-1 and then its ancestors by depth and itself -- the
canonical key order.
"""
import functools
import itertools

import torch

from .model import Block


class Tree:
    def __init__(self, tokens: list[int], parents: list[int]):
        assert len(tokens) == len(parents) and parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(parents) if i), "parents must precede children"
        self.tokens, self.parents = list(tokens), list(parents)
        self.depth = [0] * len(tokens)
        # node -> {token: children carrying it}; more than one only in trees of unmerged
        # branches (Lookahead's parallel drafts), where verify tries each
        self.kids: list[dict[int, list[int]]] = [{} for _ in tokens]
        for i in range(1, len(tokens)):
            p = parents[i]
            self.depth[i] = self.depth[p] + 1
            self.kids[p].setdefault(tokens[i], []).append(i)

    def __len__(self):
        return len(self.tokens)

    # --- builders -------------------------------------------------------------------------
    @classmethod
    def chain(cls, root: int, drafts: list[int] = ()) -> "Tree":
        return cls([root, *drafts], list(range(-1, len(drafts))))

    @classmethod
    def from_branches(cls, root: int, branches: list[list[int]]) -> "Tree":
        """Merge token sequences that continue the root into one tree; shared prefixes share nodes."""
        t = cls([root], [-1])
        for branch in branches:
            node = 0
            for tok in branch:
                if tok not in t.kids[node]:
                    t.tokens.append(tok)
                    t.parents.append(node)
                    t.depth.append(t.depth[node] + 1)
                    t.kids.append({})
                    t.kids[node][tok] = [len(t.tokens) - 1]
                node = t.kids[node][tok][0]
        return t

    @classmethod
    def parallel(cls, root: int, branches: list[list[int]]) -> "Tree":
        """Branches side by side, shared prefixes not merged (Lookahead's parallel multi-branch draft)."""
        tokens, parents = [root], [-1]
        for branch in branches:
            for d, tok in enumerate(branch):
                parents.append(0 if d == 0 else len(tokens) - 1)
                tokens.append(tok)
        return cls(tokens, parents)

    @classmethod
    def from_choices(cls, root: int, cands: list[list[int]], paths=None) -> "Tree":
        """cands[d] are ranked candidates for depth d+1; paths are rank tuples like (0, 2).

        A path (r0, r1, ...) is the branch cands[0][r0], cands[1][r1], ...: Medusa's sparse
        tree. paths=None takes every combination: the product tree.
        """
        if paths is None:
            paths = [p for d in range(1, len(cands) + 1)
                     for p in itertools.product(*(range(len(c)) for c in cands[:d]))]
        return cls.from_branches(root, [[cands[d][r] for d, r in enumerate(p)] for p in paths])

    def drop(self, nodes) -> None:
        """Make nodes (and so their descendants) unreachable for verify; indices and slots stay."""
        for i in nodes:
            self.kids[self.parents[i]][self.tokens[i]].remove(i)

    # --- flattening -----------------------------------------------------------------------
    def path_to(self, i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def block(self, cur: int, device=None) -> Block:
        """Rows for this tree at committed length cur: node i writes slot cur+i."""
        n = len(self)
        extra, depth = _layout(tuple(self.parents))
        return Block(torch.tensor([self.tokens]), depth + cur, torch.arange(cur, cur + n),
                     torch.full((1, n), cur, dtype=torch.long), torch.where(extra < 0, -1, extra + cur)).to(device)


@functools.lru_cache(maxsize=256)
def _layout(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor table (1, n, E): node i's path from the root, -1 padded; depths (1, n)) of a tree
    shape. Cached: a method with a static tree (Medusa, ProPD) builds its visibility only once."""
    n = len(parents)
    paths = [[]] * n
    for i, p in enumerate(parents):
        paths[i] = (paths[p] if p >= 0 else []) + [i]
    E = max(map(len, paths))
    extra = torch.tensor([[p + [-1] * (E - len(p)) for p in paths]])
    return extra, torch.tensor([[len(p) - 1 for p in paths]])


class Sampler:
    """Greedy (temperature 0) or seeded sampling with one uniform per output position.

    Output position i always uses uniform u[i] of the seeded stream, whatever the method,
    so sampling at an accepted tree node is exactly what AR does at that position.
    """

    def __init__(self, temperature=0.0, top_k=0, top_p=1.0, seed=0, n=4096):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        g = torch.Generator().manual_seed(seed)
        self.u = torch.rand(n, generator=g, dtype=torch.float64).tolist()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def pick(self, logits: torch.Tensor, i: int) -> int:
        if self.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.double() / self.temperature, -1)
        probs, ids = probs.sort(descending=True, stable=True)
        if self.top_k:
            probs[self.top_k:] = 0
        if self.top_p < 1.0:  # keep the smallest head of the ranking whose mass reaches top_p
            probs[probs.cumsum(0) - probs >= self.top_p] = 0
        cdf = probs.cumsum(0)
        j = torch.searchsorted(cdf, self.u[i] * cdf[-1], right=True)
        return int(ids[min(int(j), int((probs > 0).sum()) - 1)])


def verify(tree: Tree, logits: torch.Tensor, sampler: Sampler, n_out: int):
    """Accept the longest path that AR would produce.

    logits (n, V) are the tree rows' logits; n_out is the number of tokens emitted so far.
    At each node on the path the target token is what AR would emit there; descend while
    a child carries it (trying each, when unmerged branches put several there). Returns (path of node indices from the root, emitted tokens):
    the path's draft tokens followed by the target at its last node.
    """
    targets = logits.argmax(-1).tolist() if sampler.greedy else None
    logits = logits if sampler.greedy else logits.cpu()  # one read-back, not one per node

    def walk(node, n):  # the longest accepted path below node, whose target is output position n
        t = targets[node] if targets else sampler.pick(logits[node], n)
        best = ([node], [t])
        for child in tree.kids[node].get(t, ()):  # several only for unmerged duplicate branches
            path, out = walk(child, n + 1)
            if len(path) + 1 > len(best[0]):
                best = ([node, *path], [t, *out])
        return best

    return walk(0, n_out)


def group_rows(blk: Block, hosts: list[int], M: int, first_slot: int, reserved=None, chained: bool = True) -> Block:
    """A group of M rows after each host node of a tree block (BiTA's mask tokens, Hidden
    Transfer's pseudo states): row i of a host at position p sits at p+1+i, writes slot
    first_slot + (group * M + i) and sees the reserved slots, the host's path and its group's
    rows 0..i (chained=False: itself only). No tree row sees them."""
    dev = blk.slots.device
    H = len(hosts)
    h = torch.tensor(hosts, device=dev)
    i = torch.arange(M, device=dev)
    pos = (blk.pos[0, h][:, None] + 1 + i).reshape(1, H * M)
    slots = first_slot + torch.arange(H * M, device=dev)
    group = slots.view(H, 1, M).expand(H, M, M)
    sees = i[None, None] <= i[None, :, None] if chained else i[None, None] == i[None, :, None]
    group = torch.where(sees, group, -1)
    path = blk.extra[0, h][:, None].expand(H, M, -1)
    parts = [path, group]
    if reserved is not None and len(reserved):
        parts.insert(0, reserved.to(dev).view(1, 1, -1).expand(H, M, -1))
    extra = torch.cat(parts, -1).reshape(1, H * M, -1)
    prefix = blk.prefix[:, :1].expand(1, H * M)
    return Block(torch.zeros(1, H * M, dtype=torch.long, device=dev), pos, slots, prefix, extra)
