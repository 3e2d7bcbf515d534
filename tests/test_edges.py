"""Every method at the engine's edges: a cache just large enough for the prompt and the new
tokens, so the last steps have room for a few rows only and every "no room" path runs, in exact
mode (bitwise AR) and fast mode (AR's tokens), with drafts that do get accepted, at least the
method's declared floor of tokens per step; and caches too small for the new tokens, where every
method must stop where AR stops, with AR's bits."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import ARGS, METHODS, Budgets, ProductsOf, drafter, each_method, feed, random_model, reaches_floor
from nanospec.drafter import Drafter
from nanospec.engine import generate, shapes
from nanospec.methods import METHODS as REGISTRY

OWN_ROWS = [n for n in METHODS if REGISTRY[n].groups is not Drafter.groups]  # rows after the tree: masks, pseudo...
HEAD_ROWS = [n for n in OWN_ROWS if REGISTRY[n].propose is Drafter.propose]  # ...whose drafts are the head's rows


@pytest.mark.parametrize("name", METHODS)
def test_every_method_in_a_near_full_cache_reaches_its_floor(name, device):
    """Bitwise AR with drafts accepted to the cache's last slots, and the drafts as good as the method says
    (Drafter.floor): a method that drafts worse (an off-by-one in its proposal: test_contract.py) fails here,
    though it is still exact."""
    reaches_floor(name, device)


@pytest.mark.parametrize("seed, exact, dtype", [(0, False, torch.float32), (1, True, torch.float32),
                                               (2, True, torch.bfloat16)])
@pytest.mark.parametrize("name", OWN_ROWS)
def test_own_rows_follow_the_budget(name, seed, exact, dtype):
    """Under a planner a step runs min(ahead, budget) of a method's own draft rows per group (masks, pseudo rows,
    adaptive tokens; straightforward BiTA's root group keeps its M), lays out the rows it prices, and decodes AR's
    output (exact mode: the logits of every emitted token bitwise AR's). Each mode a seed of its own: a method's
    random variants (Drafter.random) take turns."""
    model = random_model(ARGS, seed=11, dtype=dtype)
    prompt = [3, 9, 4, 1, 7, 12, 5]
    kw = dict(max_new_tokens=40, eos_id=-1, exact=exact, record_logits=exact)
    ar = generate(model, prompt, **kw)
    d = feed(drafter(name, model, seed), [prompt], [ar], p=0.8, seed=2)
    d.planner, seen, groups = Budgets([2, 0, 1, 5, 3, 1, 4, 2, 2]), [], d.groups

    def spy(tree, n, budget=None):
        g = groups(tree, n, budget)
        seen.append((d.planner.last, budget, d.own_depths(budget), n + len(g.hosts) * g.M, d.rows(n, budget)))
        return g
    d.groups = spy
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and (not exact or torch.equal(out.logits, ar.logits))
    assert all(budget == b and own == min(d.ahead, b) and laid == priced for b, budget, own, laid, priced in seen)
    assert {own for _, _, own, *_ in seen} == set(range(1, d.ahead + 1))


@pytest.mark.parametrize("name", HEAD_ROWS)
def test_a_step_reads_the_head_once(name):
    """A drafter whose drafts are the head's own rows (masks, pseudo states, adaptive tokens) takes their logits
    from the step's one head product: fast mode calls the lm_head once a step and once for the prefill, never
    again for the drafts (at a few rows a second product costs what the first does: it reads the weights)."""
    model = random_model(ARGS, seed=11)
    d, spy = drafter(name, model), ProductsOf(model.lm_head.weight)
    start = d.start
    d.start = lambda dec: (start(dec), spy.calls.clear())  # from the first step on (BiTA's shallow prompt runs rows)
    with spy:
        out = generate(model, [3, 9, 4, 1, 7, 12, 5], d, max_new_tokens=24, eos_id=-1)
    assert out.steps > 2 and len(spy.calls) == out.steps


@pytest.mark.parametrize("name", METHODS)
@each_method(25)
@given(seed=st.integers(0, 2**16), plen=st.integers(1, 12), room=st.integers(1, 40), exact=st.booleans())
def test_a_full_cache_stops_every_method_where_ar_stops(device, name, seed, plen, room, exact):
    """A cache with room for fewer tokens than asked: the method stops on "cache_full" after as
    many tokens as AR at the same capacity, with AR's tokens (and, in exact mode, AR's bits).
    The drafts are fed the truth, so long accepted trees run into the cache's end."""
    model = random_model(ARGS, seed=seed % 7, device=device)
    prompt = torch.randint(0, ARGS.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    n = room + 16
    d = drafter(name, model, seed)
    Q, _, W = shapes([d], plen, n)
    kw = dict(max_new_tokens=n, exact=exact, Q=Q, tail=W, eos_id=-1, record_logits=True)
    capacity = plen - 1 + room  # the prompt but its last token, then `room` new tokens
    ar = generate(model, prompt, n_slots=capacity + 1, **kw)
    feed(d, [prompt], [ar], 0.9, seed)
    out = generate(model, prompt, d, n_slots=capacity + d.reserved_slots + 1, **kw)
    assert ar.stop == out.stop == "cache_full" and len(ar.tokens) == room
    assert out.tokens == ar.tokens
    if exact:
        assert torch.equal(out.logits, ar.logits)
