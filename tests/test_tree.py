import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import from_branches, keys_in_order, path_to
from nanospec.forward import context
from nanospec.model import Llama, ModelArgs
from nanospec.tree import Layout, Template, Tree, product_paths
from nanospec.verify import Sampler, accept, sample_verify

branches_st = st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=8)


@given(branches_st)
def test_from_branches_merges_shared_prefixes(branches):
    t = from_branches(9, branches)
    prefixes = {tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
    assert len(t) == 1 + len(prefixes)
    paths = {tuple(t.tokens[j] for j in path_to(t, i)[1:]): i for i in range(len(t))}
    assert len(paths) == len(t)  # no two nodes carry the same branch
    for b in branches:  # every branch is a path from the root
        assert tuple(b) in paths


def test_product_and_sparse_templates():
    cands = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    full = Template(product_paths([3, 2, 2])).tree(0, cands)
    assert len(full) == 1 + 3 + 6 + 12
    sparse = Template([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    t = sparse.tree(0, cands)
    assert t.tokens.tolist() == [0, 10, 11, 20, 21, 30] and t.parents == (-1, 0, 0, 1, 1, 3)
    assert sparse.topk == [2, 2, 1] and len(sparse) == 6
    assert sparse.tree(0, cands[:1]).tokens.tolist() == [0, 10, 11]  # one depth drafted: the paths that fit
    assert Tree.chain(5, [6, 7]).parents == (-1, 0, 1)


@given(branches_st, st.integers(0, 30), st.integers(1, 12))
def test_block_rows_see_exactly_prefix_ancestors_and_self(branches, cur, tail):
    t = from_branches(9, branches)
    blk = t.block(cur)
    assert blk.slots.tolist() == list(range(cur, cur + len(t)))
    model = Llama(ModelArgs(dim=8, n_layers=1, n_heads=2, vocab_size=10, intermediate_size=8))
    S = cur + len(t) + 1
    exact, fast = context(model, blk, S, True, tail=tail), context(model, blk, S, False)
    for i in range(len(t)):
        path = path_to(t, i)
        assert blk.pos[0, i] == cur + len(path) - 1
        canonical = list(range(cur)) + [cur + a for a in path]  # committed, ancestors by depth, self
        assert keys_in_order(exact, 0, i) == canonical  # the keys read in place, then the gathered tail
        mask = fast.mask if fast.mask is not None else torch.ones(1, len(t), fast.L, dtype=torch.bool)
        assert mask[0, i].nonzero().flatten().tolist() == canonical


@given(branches_st, st.integers(0, 2**31))
def test_greedy_verify_accepts_longest_path_ar_agrees_with(branches, seed):
    t = from_branches(1, branches)
    logits = torch.randn(len(t), 5, generator=torch.Generator().manual_seed(seed))
    target = logits.argmax(-1).tolist()
    path, out = sample_verify(t, logits, Sampler(), 0)
    # brute force: a node is acceptable when every edge on its path carries its parent's target
    ok = [i for i in range(len(t)) if all(t.tokens[c] == target[p] for p, c in zip(path_to(t, i), path_to(t, i)[1:]))]
    best = max(len(path_to(t, i)) for i in ok)
    assert len(path) == best and path == path_to(t, path[-1])
    assert out == [t.tokens[i] for i in path[1:]] + [target[path[-1]]]
    # the device version (padded as exact mode pads it) accepts the same path
    N = len(t) + 3
    lay = Layout.of(t.parents).pad(N)
    tokens = torch.tensor(t.tokens + [-1] * 3)
    dpath, demitted = accept(tokens[None], lay.batched(), torch.cat([logits, torch.randn(3, 5)])[None])
    dpath, demitted = dpath[0], demitted[0]
    assert [i for i in dpath.tolist() if i >= 0] == path and demitted.tolist()[:len(path)] == out


def test_sampler_respects_top_k_top_p_and_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    s = Sampler(temperature=1.0, seed=3, n=20000)
    counts = torch.bincount(torch.tensor([s.pick(logits, i) for i in range(20000)]), minlength=5) / 20000
    assert (counts - probs).abs().max() < 0.02
    s = Sampler(temperature=1.0, top_k=2, seed=1, n=2000)
    assert {s.pick(logits, i) for i in range(2000)} == {0, 1}
    s = Sampler(temperature=1.0, top_p=0.7, seed=1, n=2000)  # p = .61, .22, ...: the top two reach .7
    assert {s.pick(logits, i) for i in range(2000)} == {0, 1}
    assert Sampler(temperature=1.0, top_k=1).pick(logits, 0) == 0


def test_same_seed_same_uniforms():
    a, b = Sampler(temperature=1.0, seed=7, n=50), Sampler(temperature=1.0, seed=7, n=100)
    logits = torch.randn(50, 11, generator=torch.Generator().manual_seed(0))
    assert [a.pick(l, i) for i, l in enumerate(logits)] == [b.pick(l, i) for i, l in enumerate(logits)]


def test_parallel_branches_are_each_verified():
    # Figure 2 of the Lookahead paper: [on, my, knee] and [on, a, table] side by side after "sits",
    # unmerged: two nodes carry "on"
    sits, on, my, knee, a, table, chair = range(7)
    t = Tree([sits, on, my, knee, on, a, table], [-1, 0, 1, 2, 0, 4, 5])
    truth = {0: on, 1: a, 2: a, 3: a, 4: a, 5: chair, 6: a}  # target after each node
    logits = torch.full((len(t), 7), -1.0)
    for node, tok in truth.items():
        logits[node, tok] = 1.0
    path, out = sample_verify(t, logits, Sampler(), 0)
    assert path == [0, 4, 5] and out == [on, a, chair]
    dpath, demitted = accept(torch.tensor(t.tokens)[None], Layout.of(t.parents).batched(), logits[None])
    assert dpath[0].tolist() == [0, 4, 5, -1] and demitted[0].tolist() == [on, a, chair, -1]  # -1: padding
    merged = from_branches(sits, [[on, my, knee], [on, a, table]])
    assert len(merged) == len(t) - 1
