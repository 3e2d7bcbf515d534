"""Every method at the engine's edges: a cache just large enough for the prompt and the new
tokens, so the last steps have room for a few rows only and every "no room" path runs, in exact
mode (bitwise AR) and fast mode (AR's tokens), with drafts that do get accepted; and caches too
small for the new tokens, where every method must stop where AR stops, with AR's bits."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import ARGS, METHODS, Budgets, ProductsOf, check_exact, drafter, peek, random_model
from nanospec.engine import generate, shapes
from nanospec.methods.lookahead import Lookahead


@pytest.mark.parametrize("name", ["medusa", "propd", "propd-dynamic", "bita-deep", "bita-shallow-full",
                                  "bita-straight", "hidden_transfer", "sdsat"])
def test_trained_methods_in_a_near_full_cache(name, device):
    model = random_model(ARGS, seed=11, device=device)
    d = drafter(name, model)
    prompt = [3, 9, 4, 1, 7, 12, 5]
    out = check_exact(model, prompt, d, 96, fast=True, peeking=0.9, seed=5, tight=True)
    assert out.mean_accepted >= 1.5 and out.stop == "max_new_tokens"


@pytest.mark.parametrize("exact, dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
@pytest.mark.parametrize("name", ["bita-deep", "bita-shallow-full", "bita-straight", "hidden_transfer", "sdsat"])
def test_own_rows_follow_the_budget(name, exact, dtype):
    """Under a planner a step runs min(ahead, budget) of a method's own draft rows per group (masks, pseudo rows,
    adaptive tokens; straightforward BiTA's root group keeps its M), lays out the rows it prices, and decodes AR's
    output (exact mode: the logits of every emitted token bitwise AR's)."""
    model = random_model(ARGS, seed=11, dtype=dtype)
    prompt = [3, 9, 4, 1, 7, 12, 5]
    kw = dict(max_new_tokens=40, eos_id=-1, exact=exact, record_logits=exact)
    ar = generate(model, prompt, **kw)
    d = peek(drafter(name, model), ar.tokens, p=0.8, seed=2)
    d.planner, seen, groups = Budgets([2, 0, 1, 5, 3, 1, 4, 2, 2]), [], d.groups

    def spy(tree, n, budget=None):
        g = groups(tree, n, budget)
        seen.append((d.planner.last, budget, d.own(budget), n + len(g.hosts) * g.M, d.size(n, budget)))
        return g
    d.groups = spy
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and (not exact or torch.equal(out.logits, ar.logits))
    assert all(budget == b and own == min(d.ahead, b) and laid == priced for b, budget, own, laid, priced in seen)
    assert {own for _, _, own, *_ in seen} == set(range(1, d.ahead + 1))


@pytest.mark.parametrize("name", ["bita-deep", "bita-straight", "hidden_transfer", "sdsat"])
def test_a_step_reads_the_head_once(name):
    """A drafter whose drafts are the head's own rows (masks, pseudo states, adaptive tokens) takes their logits
    from the step's one head product: fast mode calls the lm_head once a step and once for the prefill, never
    again for the drafts (at a few rows a second product costs what the first does: it reads the weights)."""
    model = random_model(ARGS, seed=11)
    d, spy = drafter(name, model), ProductsOf(model.lm_head.weight)
    with spy:
        out = generate(model, [3, 9, 4, 1, 7, 12, 5], d, max_new_tokens=24, eos_id=-1)
    assert out.steps > 2 and len(spy.calls) == out.steps + 1


@pytest.mark.parametrize("exact", [True, False])
def test_lookahead_in_a_near_full_cache(exact, device):
    model = random_model(ARGS, seed=11, device=device)
    prompt = [3, 9, 4, 1, 7, 12, 5] * 3
    d = Lookahead(decoding_length=12, branch_length=6)
    Q, _, W = shapes([d], len(prompt), 40)
    kw = dict(max_new_tokens=40, exact=exact, Q=Q, n_slots=len(prompt) + 40 + 1, tail=W, eos_id=-1,
              record_logits=True)
    ar = generate(model, prompt, **kw)
    d.warm_up([prompt[-1:] + ar.tokens])  # the trie knows the continuation: long drafts to the very end
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and out.stop == "max_new_tokens" and out.mean_accepted > 3
    if exact:
        assert torch.equal(out.logits, ar.logits)


@given(name=st.sampled_from(METHODS), seed=st.integers(0, 2**16), plen=st.integers(1, 12),
       room=st.integers(1, 40), exact=st.booleans())
def test_a_full_cache_stops_every_method_where_ar_stops(device, name, seed, plen, room, exact):
    """A cache with room for fewer tokens than asked: the method stops on "cache_full" after as
    many tokens as AR at the same capacity, with AR's tokens (and, in exact mode, AR's bits).
    The drafts peek at the truth, so long accepted trees run into the cache's end."""
    model = random_model(ARGS, seed=seed % 7, device=device)
    prompt = torch.randint(0, ARGS.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    n = room + 16
    d = Lookahead(decoding_length=12, branch_length=6) if name == "lookahead" else drafter(name, model)
    Q, _, W = shapes([d], plen, n)
    kw = dict(max_new_tokens=n, exact=exact, Q=Q, tail=W, eos_id=-1, record_logits=True)
    capacity = plen - 1 + room  # the prompt but its last token, then `room` new tokens
    ar = generate(model, prompt, n_slots=capacity + 1, **kw)
    if name == "lookahead":
        d.warm_up([prompt[-1:] + ar.tokens])
    else:
        peek(d, ar.tokens, 0.9, seed)
    out = generate(model, prompt, d, n_slots=capacity + d.reserved_slots + 1, **kw)
    assert ar.stop == out.stop == "cache_full" and len(ar.tokens) == room
    assert out.tokens == ar.tokens
    if exact:
        assert torch.equal(out.logits, ar.logits)
