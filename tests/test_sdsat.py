"""SDSAT: exactness against AR of the same (fine-tuned) model, the two-step loop, the masking
process's statistics, the improved loss and training."""
import argparse

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import check_exact, model_args, peek, random_model
from nanospec.engine import generate
from nanospec import NanospecError
from nanospec.methods import model_dir
from nanospec.methods.sdsat import SDSAT, mask, sdsat_loss
from nanospec.model import ModelArgs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, hidden_dim=40)


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 24), k=st.integers(1, 5),
       width=st.integers(1, 3), diverse=st.booleans(), sampled=st.booleans())
def test_sdsat_equals_ar(device, dtype, args, seed, plen, k, width, diverse, sampled):
    model = random_model(args, seed, DTYPES[dtype], device)
    ids = [(seed + i) % args.vocab_size for i in range(k if diverse else 1)]
    d = SDSAT(ids, model.lm_head, k, width)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 20, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.mean_accepted >= 1.5  # the adaptive tokens' candidates carry the truth: drafts are accepted


def test_two_step_loop():
    """Step 1 is the root and k adaptive rows; a fully accepted chain drafts the next one from its
    adaptive rows (no step 1 in between); a partly accepted one goes back to step 1."""
    model = random_model(TINY, 3)
    prompt, k = [5, 9, 2, 7], 3
    ar = generate(model, prompt, max_new_tokens=40, eos_id=-1)
    d = peek(SDSAT([4], model.lm_head, k=k), ar.tokens, p=0.6, seed=1)
    seen, accepted = [], type(d).accepted

    def spy(dec, tree, path):
        seen.append((len(tree), len(path)))
        accepted(d, dec, tree, path)
    d.accepted = spy
    assert generate(model, prompt, d, max_new_tokens=40, eos_id=-1).tokens == ar.tokens
    assert seen[0] == (1, 1)  # draft step 1
    for (size, got), (nxt, _) in zip(seen, seen[1:]):
        whole = size == 1 or got == size  # step 1, or the whole chain accepted
        assert nxt == (k + 1 if whole else 1)
    assert {(k + 1, k + 1), (1, 1)} <= set(seen) and any(1 < g < k + 1 for _, g in seen)
    wide = SDSAT([4], None, k=3, width=2)
    t = wide.template.tree(9, torch.tensor([[11, 15], [12, 16], [13, 17]]))
    kids = [sum(p == i for p in t.parents) for i in range(len(t))]
    assert len(t) == 1 + 6 and kids[:2] == [2, 2]  # only top-1s branch


def test_masking_statistics():
    """About `rate` of the positions start a window, of a length uniform on 1..L; the replaced
    fraction matches the process's exact expectation."""
    g = torch.Generator().manual_seed(0)
    L, rate = 5, 0.1
    x = torch.zeros(400, 500, dtype=torch.long)
    mixed, replaced = mask(x, L, rate, [7], g)
    assert torch.equal(mixed == 7, replaced) and not replaced[:, 0].any()
    p_free = 1.0
    for i in range(L):  # a position is free if no window starting i back reaches it
        p_free *= 1 - rate * (L - i) / L
    frac = replaced[:, L:].float().mean().item()
    assert abs(frac - (1 - p_free)) < 0.005, frac
    # sparse windows rarely touch: run lengths are then the drawn lengths, uniform on 1..L
    _, rep = mask(torch.zeros(2000, 400, dtype=torch.long), L, 0.005, [7], g)
    runs = []
    for row in rep.tolist():
        n = 0
        for v in row + [False]:
            if v:
                n += 1
            elif n:
                runs.append(n)
                n = 0
    counts = torch.bincount(torch.tensor(runs), minlength=L + 2)[1:L + 1].float()
    assert len(runs) > 3000 and (counts / counts.mean() - 1).abs().max() < 0.12, counts
    # diverse tokens: the i-th position of a window gets the i-th id
    mixed, replaced = mask(torch.zeros(50, 300, dtype=torch.long), L, 0.02, [30, 31, 32, 33, 34], g)
    starts = replaced & ~torch.nn.functional.pad(replaced, (1, 0))[:, :-1]
    assert (mixed[starts] == 30).all() and set(mixed[replaced].tolist()) <= {30, 31, 32, 33, 34}


def test_improved_loss_trains_plain_halves_fully_and_mixed_halves_on_adaptive_rows():
    model = random_model(TINY, 1)
    x = torch.randint(5, 37, (4, 33), generator=torch.Generator().manual_seed(0))
    args = argparse.Namespace(loss="improved", window=4, mask_rate=0.2)
    loss, _ = sdsat_loss(model, x[:2], x[2:], args, [4], torch.Generator().manual_seed(1))
    mixed, rep = mask(x[2:, :-1], 4, 0.2, [4], torch.Generator().manual_seed(1))
    from nanospec.training import causal
    logits = model(causal(torch.cat([x[:2, :-1], mixed])))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(4, 32)
    assert rep.any() and torch.allclose(loss, 0.5 * (ce[:2].mean() + ce[2:][rep].mean()))
    basic, _ = sdsat_loss(model, x[:2], x[2:], argparse.Namespace(loss="basic", window=4, mask_rate=0.2), [4],
                          torch.Generator().manual_seed(1))
    assert torch.allclose(basic, ce[2:].mean())  # eq. 8: every position of the mixed sequences


def test_a_few_training_steps_reduce_the_loss():
    model = random_model(TINY, 2)
    args = argparse.Namespace(loss="improved", window=3, mask_rate=0.15)
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4] * 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = lambda: sdsat_loss(model, x[:2], x[2:], args, [4], torch.Generator().manual_seed(0))[0]
    before = loss().item()
    for _ in range(20):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.5 * before


def test_own_model_and_errors(tmp_path):
    with pytest.raises(NanospecError, match="no SDSAT model"):
        model_dir(["sdsat"], tmp_path)
    (tmp_path.with_name(tmp_path.name + "-sdsat")).mkdir()
    (tmp_path.with_name(tmp_path.name + "-sdsat") / "sdsat.json").write_text("{}")
    assert model_dir(["ar", "sdsat:k=3"], tmp_path).name.endswith("-sdsat")
    assert model_dir(["ar", "medusa"], tmp_path) == tmp_path
    with pytest.raises(NanospecError, match="separate runs"):
        model_dir(["medusa", "sdsat"], tmp_path)
    with pytest.raises(NanospecError, match="diverse"):
        SDSAT([4, 5, 6], None, k=5)
