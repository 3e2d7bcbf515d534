"""ProPD: the dynamic tree planner (cost regression, acceptance tracking, expected length),
early pruning, the drafter's exactness and the early-head trainer."""
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import check_exact, model_args, random_model
from nanospec import NanospecError
from nanospec.checkpoint import load
from nanospec.engine import generate
from nanospec.methods import propd
from nanospec.methods.medusa import Heads
from nanospec.tree import choose_tree as medusa_tree
from nanospec.engine import Nodes
from nanospec.methods.propd import EarlyHead, ProPD, pruned, load_propd, samples, train_early
from nanospec.planner import Acceptance, CostModel, FixedCost, expected_length, plan
from nanospec.model import ModelArgs
from nanospec.tree import Tree, layout


def test_regression_recovers_known_coefficients():
    cost = CostModel(alpha=1.0, lam=0.0)
    rng = random.Random(0)
    for _ in range(200):
        size = rng.choice([4, 8, 16, 32, 64])
        cost.update(size, 0.006 + 0.0002 * size)
    b0, b1 = cost.fit()
    assert b0 == pytest.approx(0.006) and b1 == pytest.approx(0.0002)
    assert cost.estimate(100) == pytest.approx(0.026)
    assert cost.fit(batch=4) is None  # batch sizes are kept apart


def test_recent_sizes_weigh_more():
    cost = CostModel(alpha=1.0, lam=1.0)
    cost.update(8, 1.0)        # old and off the line
    for _ in range(50):
        cost.update(16, 0.016)
        cost.update(32, 0.032)
    b0, b1 = cost.fit()
    assert abs(b0) < 1e-3 and b1 == pytest.approx(0.001, rel=0.05)


def test_expected_length_matches_figure_6():
    # Figure 6 of the paper (values read back from its text): head 1 ranks 1-2 are right with
    # probability 0.6 and 0.1 ('b', 'c'), head 2 with 0.3 and 0.1 ('d', 'e'); l('ab') = 0.6,
    # l('abe') = 0.06, and the tree 'abd' + 'ac' expects 1 + 0.6 + 0.6 * 0.3 + 0.1 = 1.88.
    p = [[0.6, 0.1], [0.3, 0.1]]
    assert expected_length([(0,), (0, 0), (1,)], p) == pytest.approx(1.88)
    assert expected_length([(0,), (0, 1)], p) == pytest.approx(1.66)


def test_acceptance_ema_and_rank_probabilities():
    acc = Acceptance(heads=1, topk=3, alpha=0.5)
    acc.update(0, 1)  # right at rank 2: counts for top-2 and top-3
    assert acc.P == [[0.0, 0.5, 0.5]]
    acc.update(0, 0)
    assert acc.P == [[0.5, 0.75, 0.75]] and acc.p() == [[0.5, 0.25, 0.0]]
    acc.update(0, None)
    assert acc.P == [[0.25, 0.375, 0.375]]


def test_plan_picks_the_best_speed():
    p = [[0.9, 0.05], [0.8, 0.05], [0.7, 0.05]]
    cheap_rows = CostModel()
    expensive_rows = CostModel()
    for size in (2, 4, 8, 16):
        cheap_rows.update(size, 0.010 + 0.00001 * size)
        expensive_rows.update(size, 0.010 + 0.005 * size)
    assert plan(p, cheap_rows, [1, 3, 7, 15]) == 15  # rows are free: the biggest tree
    assert plan(p, expensive_rows, [1, 3, 7, 15]) in (1, 3)
    assert plan(p, CostModel(), [3, 7]) is None  # nothing measured yet
    assert math.isclose(expected_length([], p), 1.0)


# --- early pruning and the drafter ---------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACC = [[0.5, 0.3, 0.2]] * 3


def nodes_of(tree):
    return Nodes(torch.tensor(tree.tokens), layout(tree.parents), torch.ones(len(tree), dtype=torch.bool), len(tree))


def test_pruning_takes_descendants_and_keeps_the_root():
    #        0:root
    #     1:a      2:b
    #   3:c  4:d    5:e
    tree = Tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2])
    x = torch.zeros(6, 10)
    x[0, [1, 7]] = 1.0  # root's top-2: tokens 1 and 7 -> node 2 (b) and its child 5 go
    x[1, [3, 8]] = 1.0  # a's top-2: 3 and 8 -> node 4 (d) goes
    early = lambda h: h  # the states are the early logits
    assert pruned(nodes_of(tree), x, early, k=2).nonzero()[:, 0].tolist() == [2, 4, 5]
    assert not pruned(nodes_of(tree), x, early, k=10).any()
    assert not pruned(nodes_of(Tree.chain(9)), x[:1], early, k=1).any()


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 30), size=st.integers(1, 20),
       k=st.integers(1, 4), sampled=st.booleans(), prune=st.booleans(), dynamic=st.booleans(),
       row_cost=st.sampled_from([1e-5, 1e-3]))
def test_propd_equals_ar(device, dtype, args, seed, plen, size, k, sampled, prune, dynamic, row_cost):
    """Pruning and dynamic trees change nothing: bitwise logits in exact mode, tokens in fast mode.
    The heads' candidates carry the true continuation (helpers.peek) and the early head prunes
    random branches but not the true one, so the pruned forward runs on accepted drafts. The
    planner's cost model is fixed (cheap or dear rows), so its plans do not depend on timings."""
    model = random_model(args, seed, DTYPES[dtype], device)
    torch.manual_seed(seed)
    heads = Heads(args.dim, args.vocab_size, 3).init_from(model.lm_head).to(device=device, dtype=DTYPES[dtype])
    early = EarlyHead(args.dim, args.vocab_size, 3, args.norm_eps).to(device=device, dtype=DTYPES[dtype])
    layer = seed % args.n_layers + 1 if args.n_layers > 1 else 1
    d = ProPD(heads, medusa_tree(ACC, size), ACC, early if prune else None, layer, k, dynamic,
              sizes=(1, 3, size), replan=4, cost=FixedCost(1e-2, row_cost))
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 24, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.mean_accepted >= 1.5
    if prune and not dynamic and size >= 3 and 2 * k <= args.vocab_size:  # wrong branches to prune
        assert d.pruned_rows > 0


class FakeDec:
    def __init__(self):
        self.out, self.cur, self.cand_lists = [], 0, None


def test_acceptance_resolves_each_prediction_when_its_token_arrives():
    d = ProPD(Heads(4, 10, 2), [(0,)], [[0.5, 0.5], [0.5, 0.5]], dynamic=True)
    d.accept.alpha = 1.0  # remember only the latest outcome
    dec = FakeDec()
    d.start(dec)
    dec.out, dec.cand_lists = [1], [[5, 6], [7, 8]]  # the root; head 0 guesses output 1, head 1 output 2
    d.accepted(dec, None, [0])
    assert d.accept.P == [[0.5, 1.0], [0.5, 1.0]]  # the prior: nothing resolved yet
    dec.out = [1, 6, 9]
    d.accepted(dec, None, [0])
    assert d.accept.P[0] == [0.0, 1.0]  # output 1 was 6: head 0's rank 2
    assert d.accept.P[1] == [0.0, 0.0]  # output 2 was 9: not in head 1's top 2
    assert [q[0] for q in d.pending] == [3, 4]  # the latest guesses wait


def test_the_plan_is_redone_only_when_the_sequence_moves(monkeypatch):
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=13, hidden_dim=24)
    model = random_model(args, 0)
    d = ProPD(Heads(16, 13, 3).init_from(model.lm_head), medusa_tree(ACC, 6), ACC, dynamic=True,
              sizes=(1, 2, 6), replan=16)
    calls = []
    real = propd.plan
    monkeypatch.setattr(propd, "plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = generate(model, [1, 2, 3], d, max_new_tokens=64, eos_id=-1)
    assert len(out.tokens) == 64
    # until two sizes are measured the plan is retried each step; afterwards once per 16 tokens
    assert len(calls) <= 3 + 64 // 16 + 1 < out.steps
    assert sum(d.sizes_used.values()) == out.steps


def test_early_head_training_reduces_the_loss():
    args = ModelArgs(dim=16, n_layers=3, n_heads=2, vocab_size=31, hidden_dim=24)
    model = random_model(args, 0)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 31, (4,), generator=g).tolist(), torch.randint(0, 31, (12,), generator=g).tolist())
            for _ in range(16)]
    x, y = samples(model, data, 1)

    def loss(head):
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(head(x), y))

    before = loss(EarlyHead(16, 31, 4, args.norm_eps).init_from(model))
    after = loss(train_early(model, data, 1, steps=30, rank=4, batch=64, lr=1e-2))
    assert after < before - 0.1


W = Path(__file__).parent.parent / "weights" / "pylm"


def test_early_heads_for_another_layer_are_refused():
    model = load(W)
    with pytest.raises(NanospecError, match="layers"):
        load_propd(model, W, layer=7)


def test_regression_last_row_of_the_block():
    """Found by hypothesis: the accepted node at the block's last row took silu's scalar tail
    path on CPU, 1.9e-6 off AR's logits (fixed by model.rowwise)."""
    args = ModelArgs(dim=27, n_layers=3, n_heads=3, n_kv_heads=3, vocab_size=115, hidden_dim=35, head_dim=8,
                     rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_embeddings=True)
    seed = 3487
    model = random_model(args, seed)
    torch.manual_seed(seed)
    heads = Heads(args.dim, args.vocab_size, 3).init_from(model.lm_head)
    d = ProPD(heads, medusa_tree(ACC, 19), ACC, None, 1, 1, True, sizes=(1, 3, 19), replan=4)
    prompt = torch.randint(0, args.vocab_size, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
    check_exact(model, prompt, d, 24, dict(temperature=1.0, top_p=0.9, seed=seed), fast=False)
