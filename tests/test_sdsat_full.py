"""sdsat_full, the paper's SDSAT: exactness against AR of its own fine-tuned model, the masking
process's statistics, the improved loss and training."""
import argparse

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import check_exact, descend, model_args, random_model
from nanospec import NanospecError
from nanospec.forward import run
from nanospec.methods import model_dir
from nanospec.methods.sdsat import SDSAT
from nanospec.methods.sdsat_full import mask, sdsat_loss
from nanospec.model import ModelArgs

TINY = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)


@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 24), k=st.integers(1, 5),
       width=st.integers(1, 3), diverse=st.booleans())
def test_adaptive_ids_equal_ar(device, args, seed, plen, k, width, diverse):
    """Adaptive tokens as vocabulary ids of the (fine-tuned) model: its own AR, bitwise."""
    model = random_model(args, seed, device=device)
    ids = [(seed + i) % args.vocab_size for i in range(k if diverse else 1)]
    d = SDSAT(None, k, width, ids=ids)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = check_exact(model, prompt, d, 20, {}, peeking=0.9, seed=seed)
    assert out.tokens_per_step >= 1.5


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
    from nanospec.training.loop import causal
    logits = run(model, causal(torch.cat([x[:2, :-1], mixed])))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(4, 32)
    assert rep.any() and torch.allclose(loss, 0.5 * (ce[:2].mean() + ce[2:][rep].mean()))
    basic, _ = sdsat_loss(model, x[:2], x[2:], argparse.Namespace(loss="basic", window=4, mask_rate=0.2), [4],
                          torch.Generator().manual_seed(1))
    assert torch.allclose(basic, ce[2:].mean())  # eq. 8: every position of the mixed sequences


def test_a_few_training_steps_reduce_the_loss():
    model = random_model(TINY, 2)
    args = argparse.Namespace(loss="improved", window=3, mask_rate=0.15)
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4] * 4)
    loss = lambda: sdsat_loss(model, x[:2], x[2:], args, [4], torch.Generator().manual_seed(0))[0]
    before, after = descend(loss, model.parameters(), 3e-3, 20)
    assert after < 0.5 * before


def test_own_model_and_errors(tmp_path):
    with pytest.raises(NanospecError, match="no SDSAT model"):
        model_dir(["sdsat_full"], tmp_path)
    (tmp_path.with_name(tmp_path.name + "-sdsat")).mkdir()
    (tmp_path.with_name(tmp_path.name + "-sdsat") / "sdsat.json").write_text("{}")
    assert model_dir(["ar", "sdsat_full:k=3"], tmp_path).name.endswith("-sdsat")
    assert model_dir(["ar", "medusa"], tmp_path) == tmp_path
    with pytest.raises(NanospecError, match="separate runs"):
        model_dir(["medusa", "sdsat_full"], tmp_path)
    with pytest.raises(NanospecError, match="diverse"):
        SDSAT(None, k=5, ids=[4, 5, 6])
