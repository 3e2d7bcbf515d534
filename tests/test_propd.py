"""ProPD's dynamic tree planner: the cost regression, acceptance tracking, expected length."""
import math
import random

import pytest

from nanospec.methods.propd import Acceptance, CostModel, expected_length, plan


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
    assert plan(p, CostModel(), [3, 7]) == 3  # nothing measured yet: the first size
    assert math.isclose(expected_length([], p), 1.0)


# --- early pruning: exactness with a random early head that prunes often -----------------------
import torch
from hypothesis import given, strategies as st

from helpers import model_args, random_model
from nanospec.engine import generate, shapes
from nanospec.methods.medusa import Heads, choose_tree as medusa_tree
from nanospec.methods.propd import EarlyHead, ProPD

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 30), size=st.integers(1, 20),
       k=st.integers(1, 4), sampled=st.booleans())
def test_pruned_verification_equals_ar(device, dtype, args, seed, plen, size, k, sampled):
    model = random_model(args, seed, DTYPES[dtype], device)
    torch.manual_seed(seed)
    heads = Heads(args.dim, args.vocab_size, 3).init_from(model.lm_head).to(device=device, dtype=DTYPES[dtype])
    early = EarlyHead(args.dim, args.norm_eps)
    with torch.no_grad():
        early.res.weight.normal_()  # a poor early head: prunes true continuations too
    early = early.to(device=device, dtype=DTYPES[dtype])
    layer = seed % args.n_layers + 1 if args.n_layers > 1 else 1
    d = ProPD(heads, medusa_tree([[0.5, 0.3, 0.2]] * 3, size), early, layer, k)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    Q, S = shapes([d], plen, 24)
    kw = dict(max_new_tokens=24, Q=Q, n_slots=S, eos_id=-1, record_logits=True, **sampling)
    ar, out = generate(model, prompt, exact=True, **kw), generate(model, prompt, d, exact=True, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits)
    if dtype == "fp32":
        assert generate(model, prompt, d, **kw).tokens == generate(model, prompt, **kw).tokens
