"""Sampler.pick's distribution away from T=1: softmax(logits / T), then top-k or top-p renormalised.

Each test draws N = 20000 tokens (output positions 0..N-1 of one seeded stream) and bounds the total
variation distance to the expected distribution by 2 sqrt(V/N) = 0.035 for V = 6 tokens: 4x the
largest mean TV sampling noise can give (sum of sqrt(p(1-p)/N) / 2 <= sqrt(V/N) / 2 = 0.0087; for
these distributions it is 0.003-0.006, and 20000 simulated runs never exceeded 0.017). Wrong
temperature handling lands far beyond it: T=0.5 and T=2 are 0.46 apart (multiplying by T instead of
dividing swaps them), and each is over 0.2 from T=1.
"""
import math

import pytest
import torch

from nanospec.verify import Sampler

LOGITS = torch.tensor([2.0, 1.0, 0.0, -0.5, -1.5, -3.0])  # already in rank order: token i is rank i
N, SEED = 20000, 0
BOUND = 2 * math.sqrt(len(LOGITS) / N)


def freqs(**kw) -> torch.Tensor:
    s = Sampler(seed=SEED, n=N, **kw)
    return torch.bincount(torch.tensor([s.pick(LOGITS, i) for i in range(N)]), minlength=len(LOGITS)).double() / N


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def softmax(T: float) -> torch.Tensor:
    return torch.softmax(LOGITS.double() / T, -1)


def renorm(p: torch.Tensor, keep: int) -> torch.Tensor:
    q = p.clone()
    q[keep:] = 0
    return q / q.sum()


def test_the_bound_separates_the_temperatures():
    """The tests below can fail: T=0.5, T=1 and T=2 are each far beyond BOUND from one another."""
    assert BOUND < 0.036
    assert min(tv(softmax(0.5), softmax(2.0)), tv(softmax(0.5), softmax(1.0)), tv(softmax(2.0), softmax(1.0))) > 0.2


@pytest.mark.parametrize("T", [0.5, 2.0])
def test_temperature_divides_the_logits(T):
    """Frequencies follow softmax(l / T): T < 1 sharpens, T > 1 flattens (l * T would swap them)."""
    assert tv(freqs(temperature=T), softmax(T)) < BOUND


def test_top_k_renormalises_the_k_most_likely():
    """top_k=3 at T=2: only tokens 0-2 ever come, in proportion to softmax(l / 2) renormalised."""
    f = freqs(temperature=2.0, top_k=3)
    assert set(f.nonzero().flatten().tolist()) == {0, 1, 2}
    assert tv(f, renorm(softmax(2.0), 3)) < BOUND


def test_top_p_keeps_the_smallest_head_reaching_p():
    """top_p=0.85 at T=2: p = .397 .241 .146 .114 .069 .033, so the head's mass reaches .85 at the 4th
    token (.785 before it, .898 with it): tokens 0-3 are kept, renormalised, and never 4 or 5."""
    p = softmax(2.0)
    assert float(p[:3].sum()) < 0.85 <= float(p[:4].sum())
    f = freqs(temperature=2.0, top_p=0.85)
    assert set(f.nonzero().flatten().tolist()) == {0, 1, 2, 3}
    assert tv(f, renorm(p, 4)) < BOUND


@pytest.mark.parametrize("top_p, keep", [(0.25, 1), (0.5, 2), (0.75, 3), (0.8, 4)])
def test_top_p_at_its_boundary_keeps_no_more_than_reach_it(top_p, keep):
    """Four equal logits (probabilities 1/4, sums exact): a head whose mass equals top_p reaches it, so the next
    token is not kept (top_p = 0.5: two tokens, not three)."""
    s = Sampler(temperature=1.0, top_p=top_p, seed=SEED, n=400)
    assert {s.pick(torch.zeros(4), i) for i in range(400)} == set(range(keep))
