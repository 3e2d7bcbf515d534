"""Verification and sampling: which of a tree's drafts AR would have emitted, and what a step hands back.

A step settles where it verifies: the accepted path found, its keys committed, the drafts at its end proposed.
Greedy, on the device for every tree of a batch at once (`settle_on_device`: `accept`, KVCache.commit, the next
candidates), so a step needs one read-back: the accepted path and, for a method that drafts, the next candidates,
packed as one tensor (`pack_results`, `unpack_results`). Sampling settles on the host (`settle_on_host`, walking each
tree with `sample_verify`), each output position with its own uniform of a seeded stream (`Sampler`), so that
accepting a draft is AR drawing it.
"""
from typing import NamedTuple

import torch

from .drafter import plain
from .tree import Layout, Tree


def accept(tokens, lay: Layout, logits, alive=None):
    """Greedy verification on the device, every tree of a batch (B, N) at once: the longest path AR agrees with.
    A node is accepted when its token is its parent's argmax and its parent is accepted; the deepest accepted
    node wins (the first, among unmerged duplicate branches). Returns (path (B, E) node indices, root first,
    -1 padded; emitted (B, E) the tokens that path emits: its drafts, then the target at its end)."""
    target = logits.argmax(-1)  # (B, N)
    ok = (tokens == target.gather(1, lay.parent.clamp(min=0))) | (lay.parent < 0)  # the root is accepted
    if alive is not None:
        ok = ok & alive
    anc = lay.anc  # (B, N, E)
    good = (ok.gather(1, anc.clamp(min=0).flatten(1)).view(anc.shape) | (anc < 0)).all(-1) & (tokens >= 0)
    end = torch.argmax(good * (lay.depth + 1), -1)  # (B,) the deepest; padding nodes hold token -1; no host sync
    path = anc.gather(1, end[:, None, None].expand(-1, 1, anc.shape[-1]))[:, 0]
    return path, torch.where(path >= 0, target.gather(1, path.clamp(min=0)), -1)


def pack_results(path, emitted, depth=None, cands=None, alive=None) -> torch.Tensor:
    """A greedy step's results as one tensor (B, X), for its one read-back: per sequence, the accepted path (E,)
    and its tokens (E,), both -1 padded, then, for a method that drafts, the depths drafted (1,) and the next
    candidates (K, R), then, for one that prunes (ProPD), which nodes it verified (N,)."""
    more = [depth[:, None], cands.flatten(1)] if cands is not None else []
    return torch.cat([path, emitted] + more + ([alive.long()] if alive is not None else []), -1)


def unpack_results(row: list, E: int, R: int, N: int = 0):
    """pack_results's for one sequence, read back (row: its row as a host list; N: nodes verified or not): (path,
    emitted tokens, the candidates of the depths drafted as a host tensor (D, R) and as lists, or None and None, the
    nodes left unverified)."""
    path = [i for i in row[:E] if i >= 0]
    emitted = row[E:E + len(path)]
    depth = row[2 * E] if len(row) > 2 * E + N else 0
    pruned = [i for i, a in enumerate(row[len(row) - N:]) if not a] if N else []
    if not depth:
        return path, emitted, None, None, pruned
    lists = [row[2 * E + 1 + d * R:2 * E + 1 + (d + 1) * R] for d in range(depth)]
    return path, emitted, torch.tensor(lists), lists, pruned


class Step(NamedTuple):
    """One sequence's step as the host holds it (what engine.generate's on_step gets)."""
    tree: Tree                     # the tree verified
    path: list[int]                # the accepted path's nodes, root first
    tokens: list[int]              # the tokens emitted: the path's drafts, then the bonus
    budget: int | None             # the planner's (None: no planner)
    rows: int                      # the sequence's rows: the tree's nodes, then the method's own
    pruned: list[int]              # the tree's nodes left unverified (ProPD)
    logits: torch.Tensor | None    # the emitted tokens' logits, if recorded
    whole: Tree                    # the whole draft, before trimming to the budget (the planner scores it)


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


def sample_verify(tree: Tree, logits: torch.Tensor, sampler: Sampler, n_out: int, alive=None):
    """Verification on the host, walking the tree (sampling; `accept` is the greedy device version).

    logits (n, V) are the tree rows' logits; n_out is the number of tokens emitted so far. At
    each node on the path the target is what AR would emit there (sampled with that position's
    uniform); descend while a child carries it, trying each where unmerged branches put several.
    Returns (path of node indices from the root, emitted tokens: the path's drafts, then the target).
    """
    tokens, n = tree.token_list(), len(tree)
    alive = [True] * n if alive is None else alive.tolist()
    kids = [[] for _ in range(n)]
    for i in range(1, n):
        if alive[i]:
            kids[tree.parents[i]].append(i)
    logits = logits.cpu()

    def walk(node, pos):  # the longest accepted path below node, whose target is output position pos
        t = sampler.pick(logits[node], pos)
        best = ([node], [t])
        for child in kids[node]:
            if tokens[child] == t:
                path, out = walk(child, pos + 1)
                if len(path) + 1 > len(best[0]):
                    best = ([node, *path], [t, *out])
        return best

    return walk(0, n_out)


def settle_on_device(cache, forms, drafter, out, tokens, lay: Layout, cur, cache_rows):
    """A greedy step settled inside its device program, every sequence of the batch at once: the accepted path
    (accept), its keys committed (KVCache.commit), and the drafts at its end proposed, as one tensor for the one
    read-back (pack_results). forms: the device's product forms (None: plain); out: the method's forward's Out; cur,
    cache_rows: each sequence's cursor and cache row (cache_rows None: the cache's own order)."""
    if drafter.is_ar:  # its path is its root alone, accepted, its key already in place
        path, emitted = lay.anc[:, 0], out.logits[:, :1].argmax(-1)
    else:
        path, emitted = accept(tokens, lay, out.logits, out.alive)  # (B, E) each
        cache.commit(cache.arange[:len(cur)] if cache_rows is None else cache_rows, cur, path)
    if out.draft_inputs is None:
        return pack_results(path, emitted, alive=out.alive)
    end, b = path.max(-1).values, cache.arange[:len(path)]  # each path's deepest node (indices grow along a path)
    cands = drafter.propose(out.draft_inputs[b, end], forms or plain).topk(max(drafter.topk), dim=-1).indices
    depth = out.depths[b, end] if out.depths is not None else torch.full_like(end, cands.shape[1])  # cands (B, K, R)
    return pack_results(path, emitted, depth, cands, out.alive)


def settle_on_host(cache, forms, drafter, decs: list, trees: list[Tree], res, index: list[int]) -> list:
    """A sampling step settled on the host: each tree walked with its sequence's uniforms (sample_verify), the
    accepted keys committed (KVCache.commit, as settle_on_device does), and the drafts at each path's end proposed,
    one product for the cohort. decs: the cohort's sequences (each its sampler, tokens out, cache row cache_row,
    cursor cur); res: the step program's (logits, draft_inputs, depths, alive); index: each sequence's row in the batch.
    Per sequence: (path, emitted, cands (D, R), cands as lists, nodes pruned)."""
    logits, draft_inputs, depths, alive = res
    paths = [sample_verify(t, logits[b, :len(t)], x.sampler, len(x.out), None if alive is None else alive[b, :len(t)])
             for b, x, t in zip(index, decs, trees)]
    E = max(len(p) for p, _ in paths)
    keep = lambda v: torch.tensor(v, device=cache.kv.device)
    cache.commit(keep([x.cache_row for x in decs]), keep([x.cur for x in decs]),
                 keep([p + [-1] * (E - len(p)) for p, _ in paths]))
    depth = [0] * len(decs)  # the depths each path's end drafted
    if draft_inputs is not None:
        b, ends = keep(index), keep([p[-1] for p, _ in paths])
        top = drafter.propose(draft_inputs[b, ends], forms or plain).topk(max(drafter.topk), -1).indices.cpu()
        depth = depths[b, ends].tolist() if depths is not None else [top.shape[1]] * len(decs)
    return [(p, e, top[i, :k], top[i, :k].tolist(), []) if k else (p, e, None, None, [])
            for i, ((p, e), k) in enumerate(zip(paths, depth))]
