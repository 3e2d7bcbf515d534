"""The contract: every accepted position's logits bitwise equal AR's in exact mode; tokens equal in both modes."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import Adversary, model_args, random_model
from nanospec.engine import generate, shapes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_pair(model, prompt, exact, draft_seed, n_new=20, extra_rows=0, reserved=0, **sampling):
    """AR and an adversarial drafter on the same prompt, with the same Q and S."""
    probe = Adversary([], 1, max_nodes=12, extra_rows=extra_rows, reserved=reserved)
    Q, S, W = shapes([probe], len(prompt), n_new)
    kw = dict(max_new_tokens=n_new, exact=exact, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True, **sampling)
    ar = generate(model, prompt, **kw)
    adv = Adversary(ar.tokens, model.args.vocab_size, draft_seed, 12, extra_rows, reserved)
    return ar, generate(model, prompt, adv, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 40),
       extra=st.sampled_from([0, 3]), reserved=st.sampled_from([0, 5]))
def test_exact_greedy_logits_bitwise(device, dtype, args, seed, plen, extra, reserved):
    model = random_model(args, seed, DTYPES[dtype], device)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    ar, adv = run_pair(model, prompt, True, seed, extra_rows=extra, reserved=reserved)
    assert adv.tokens == ar.tokens
    assert torch.equal(adv.logits, ar.logits), "logits of accepted positions differ from AR"
    assert adv.steps <= ar.steps


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 30),
       temperature=st.sampled_from([0.7, 1.0, 1.5]), top_k=st.sampled_from([0, 5]),
       top_p=st.sampled_from([1.0, 0.9]))
def test_exact_sampled_equals_ar_sampling(device, dtype, args, seed, plen, temperature, top_k, top_p):
    model = random_model(args, seed, DTYPES[dtype], device)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    ar, adv = run_pair(model, prompt, True, seed, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    assert adv.tokens == ar.tokens
    assert torch.equal(adv.logits, ar.logits)


@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 40),
       temperature=st.sampled_from([0.0, 1.0]))
def test_fast_mode_tokens_equal_ar(device, args, seed, plen, temperature):
    """Fast mode (SDPA, variable shapes) is not bitwise, but its tokens must match in fp32."""
    model = random_model(args, seed, torch.float32, device)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    ar, adv = run_pair(model, prompt, False, seed, extra_rows=3, temperature=temperature, seed=seed)
    assert adv.tokens == ar.tokens
    torch.testing.assert_close(adv.logits, ar.logits, rtol=1e-4, atol=1e-4)


def test_adversary_gets_drafts_accepted(device):
    """The exactness tests would be vacuous if no draft token were ever accepted."""
    from nanospec.model import ModelArgs
    model = random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, intermediate_size=48),
                         device=device)
    ar, adv = run_pair(model, list(range(10)), True, draft_seed=1, n_new=40)
    assert adv.tokens_per_step > 1.5 and adv.steps < ar.steps


def test_stops_on_eos_like_ar(device):
    from nanospec.model import ModelArgs
    args = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=12, intermediate_size=30)
    model = random_model(args, seed=3, device=device)
    ref = generate(model, [1, 2, 3], max_new_tokens=60, eos_id=-1)
    eos = ref.tokens[7]  # a token AR emits: stop there
    model.args.eos_id = eos
    Q, S, W = shapes([Adversary([], 1)], 3, 60)
    ar = generate(model, [1, 2, 3], max_new_tokens=60, exact=True, Q=Q, n_slots=S, tail=W)
    adv = generate(model, [1, 2, 3], Adversary(ref.tokens, 12, 5), max_new_tokens=60, exact=True, Q=Q, n_slots=S,
                   tail=W)
    assert ar.stop == adv.stop == "eos"
    assert ar.tokens == adv.tokens == ref.tokens[:ref.tokens.index(eos) + 1]


def test_cache_full_stops_cleanly(device):
    from nanospec.model import ModelArgs
    model = random_model(ModelArgs(dim=24, n_layers=1, n_heads=2, vocab_size=30, intermediate_size=30), device=device)
    ref = generate(model, [1, 2, 3], max_new_tokens=40, eos_id=-1)
    for drafter in (None, Adversary(ref.tokens, 30, 2)):
        out = generate(model, [1, 2, 3], drafter, max_new_tokens=40, n_slots=20, Q=16, eos_id=-1, exact=True)
        assert out.stop == "cache_full"
        assert 0 < len(out.tokens) < 40 and out.tokens == ref.tokens[:len(out.tokens)]


def test_exact_block_below_the_minimum_is_refused():
    """Blocks under 16 rows would put rows on MKL's small-GEMM tail path (devices.MIN_BLOCK): refused by generate,
    and by a Decoding made directly (fast mode has no block, so any Q)."""
    from nanospec import NanospecError
    from nanospec.cache import KVCache
    from nanospec.engine import Decoding
    from nanospec.model import ModelArgs
    model = random_model(ModelArgs(dim=24, n_layers=1, n_heads=2, vocab_size=30, intermediate_size=30))
    with pytest.raises(NanospecError, match="at least 16 rows"):
        generate(model, [1, 2, 3], max_new_tokens=4, exact=True, Q=8)
    cache = KVCache.for_model(model, 64)
    with pytest.raises(NanospecError, match="at least 16 rows"):
        Decoding(model, cache, True, 8, [1, 2, 3])
    assert Decoding(model, cache, True, 16, [1, 2, 3]).Q == Decoding(model, cache, False, 8, [1, 2, 3]).Q * 2
