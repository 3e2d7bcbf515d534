"""Fast mode's tuned products (tuning/products.py: Forms, tuned by tune, handed over as a device's `forms`):
every form, padded or not, computes the product, a table survives its cache file, each weight shape is tuned once
per machine, and tune() fills every (shape, bucket) with a valid choice."""
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import Adversary, full_logits, random_model
from nanospec import devices
from nanospec.model import ModelArgs
from nanospec.tuning import products
from nanospec.tuning.products import BUCKETS, FORMS, Forms


def tuned(table: Forms):
    """The CPU's defaults with table as fast mode's products."""
    return replace(devices.of("cpu"), forms=table)

TINY = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)


@given(form=st.sampled_from(sorted(FORMS)), M=st.integers(1, 70), extra=st.integers(0, 8), lead=st.booleans())
def test_every_form_and_padding_computes_the_product(form, M, extra, lead):
    torch.manual_seed(M)
    proj = torch.nn.Linear(24, 33, bias=False)
    x = torch.randn(1, M, 24) if lead else torch.randn(M, 24)
    b = next((b for b in BUCKETS if b >= M), None)
    k = Forms({(33, 24, b): (form, M + extra)} if b else {})
    y = k(proj, x)
    assert y.shape == (*x.shape[:-1], 33)
    assert y.is_contiguous()  # row-major, as F.linear's: a transposed layout slows the ops after it
    torch.testing.assert_close(y, proj(x), rtol=1e-5, atol=1e-5)


def test_a_drafters_own_products_are_tuned_with_the_models():
    """A drafter's product of a shape the model lacks (a draft vocabulary's rows of the lm_head) gets its forms too:
    untuned, it would run F.linear, the slowest form at a few rows."""
    from nanospec.methods.medusa import Heads, Medusa
    model = random_model(TINY, seed=3)
    medusa = Medusa(Heads(TINY.dim, TINY.vocab_size, 2, model.lm_head, draft_vocab=7), [(0,), (0, 0)])
    table = products.tune(model, medusa, buckets=(1, 2), reps=1)
    assert {(7, TINY.dim, 1), (7, TINY.dim, 2)} <= set(table.table)
    assert not any(s[0] == 7 for s in products.tune(model, buckets=(1,), reps=1).table)


def test_padding_runs_the_product_on_more_rows():
    """The table's row count is what the product sees (zero rows added), not a no-op."""
    seen = []
    FORMS["spy"] = lambda x, w, wt: seen.append(x.shape[0]) or x @ w.T
    try:
        proj = torch.nn.Linear(8, 5, bias=False)
        x = torch.randn(3, 8)
        y = Forms({(5, 8, 3): ("spy", 4)})(proj, x)
    finally:
        del FORMS["spy"]
    assert seen == [4] and y.shape == (3, 5)
    torch.testing.assert_close(y, proj(x))


def test_tuned_table_round_trips_and_keeps_fast_mode_close():
    model = random_model(TINY)
    table = products.tune(model, buckets=(1, 2, 3, 4), reps=1)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert set(table.table) == {(*s, b) for s in shapes for b in (1, 2, 3, 4)}
    for (_, _, b), (form, rows) in table.table.items():
        assert form in FORMS and b <= rows <= 2 * b
    assert products.from_json(products.to_json(table)).table == table.table
    ids = [1, 5, 9, 2]
    plain = full_logits(model, ids, False)
    torch.testing.assert_close(full_logits(model, ids, False, tuned(table)), plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(full_logits(model, ids, False), plain)  # no model attribute changed



def test_the_cache_tunes_each_weight_shape_once(monkeypatch, tmp_path):
    """A drafter bringing a product shape the model lacks tunes that shape alone, added to the model's file; a set of
    methods whose shapes are all known tunes nothing; each call gets its own shapes' rows, as tuned."""
    from nanospec.methods.medusa import Heads, Medusa
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    asked = []

    def tune(*owners):  # each call's rows carry a form of their own, to tell whose rows survive
        shapes = {tuple(m.weight.shape) for m in products.products(*owners)}
        asked.append(shapes)
        return Forms({(*s, b): (("linear", "weight-first")[len(asked) - 1], b) for s in shapes for b in BUCKETS})

    monkeypatch.setattr(products, "tune", tune)
    model = random_model(TINY, seed=3)
    medusa = Medusa(Heads(TINY.dim, TINY.vocab_size, 2, model.lm_head, draft_vocab=7), [(0,), (0, 0)])
    own = {tuple(m.weight.shape) for m in products.products(model)}
    alone = products.tuned(model)
    assert asked == [own] and (7, TINY.dim) not in own
    both = products.tuned(model, medusa)
    assert asked[1:] == [{(7, TINY.dim)}]  # the model's shapes are not tuned again
    assert products.tuned(model, medusa).table == both.table and products.tuned(model).table == alone.table
    assert len(asked) == 2
    expect = {(*s, b): ("linear" if s in own else "weight-first", b) for s in own | {(7, TINY.dim)} for b in BUCKETS}
    assert both.table == expect and alone.table == {k: v for k, v in expect.items() if k[:2] in own}
    [path] = (tmp_path / "forms").iterdir()  # one file: the model's and the drafter's shapes
    assert products.from_json(path.read_text()).table == expect


@pytest.mark.parametrize("seed", [0, 1])
def test_a_table_that_pads_every_product_changes_no_greedy_token(seed):
    """Fast mode with every product run on padded rows decodes AR's tokens, multi-row trees
    (drafts that get accepted, and wrong branches) included."""
    from nanospec.engine import generate
    model = random_model(TINY, seed=seed)
    kw = dict(max_new_tokens=24, eos_id=-1)
    ref = generate(model, [1, 2, 3], **kw).tokens
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    dev = tuned(Forms({(*s, b): ("weight-first", min(2 * b, 64)) for s in shapes for b in BUCKETS}))
    out = generate(model, [1, 2, 3], Adversary(ref, TINY.vocab_size, seed), dev=dev, **kw)
    assert out.tokens == ref
    assert out.steps < len(ref)  # drafts were accepted: multi-row forwards ran


@pytest.mark.parametrize("exact", [False, True])
def test_tuned_forms_reach_the_heads_and_never_exact_modes_forward(exact, monkeypatch):
    """Medusa's heads project through the shared lm_head in propose, on the device's forms (a 3-row
    product, here the spy form) in either mode; exact mode's own products never use them (AR's one
    kernel), fast mode's do."""
    from nanospec.engine import generate
    from nanospec.methods.medusa import Heads, Medusa
    model = random_model(TINY, seed=3)
    heads = Heads(TINY.dim, TINY.vocab_size, 3, model.lm_head)
    seen, proposed = [], []
    monkeypatch.setitem(FORMS, "spy", lambda x, w, wt: seen.append((tuple(w.shape), x.shape[0])) or x @ w.T)
    V = (TINY.vocab_size, TINY.dim)
    dev = tuned(Forms({(*V, b): ("spy", b) for b in BUCKETS}))
    medusa = Medusa(heads, [(0,), (0, 0)])
    propose = medusa.propose
    monkeypatch.setattr(medusa, "propose", lambda h, linear: proposed.append(1) or propose(h, linear))
    out = generate(model, [1, 2, 3], medusa, max_new_tokens=6, eos_id=-1, exact=exact, dev=dev)
    assert len(out.tokens) == 6 and (V, 3) in seen and proposed
    assert (len(seen) == len(proposed)) == exact  # exact: the heads' products only


def test_the_packed_form_is_offered_where_onednn_is():
    """The packed form (a weight reordered once for oneDNN) is a choice wherever PyTorch has oneDNN;
    it computes the product (the property test above draws it) and never touches the weight itself."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN")
    assert "packed" in FORMS
    proj = torch.nn.Linear(24, 33, bias=False)
    before = proj.weight.detach().clone()
    with torch.inference_mode():
        y = Forms({(33, 24, 8): ("packed", 8)})(proj, torch.randn(8, 24))
    assert y.shape == (8, 33) and torch.equal(proj.weight, before)


def test_a_drafter_copied_runs_the_tuned_forms():
    """The bench copies drafters for each run: a copy's heads run the device's forms, packed weights included
    (prepared for the copy's own weights: an opaque oneDNN tensor is never copied), and decode AR's tokens."""
    import copy

    from nanospec.engine import generate
    from nanospec.methods.medusa import Heads, Medusa
    model = random_model(TINY, seed=3)
    form = "packed" if "packed" in FORMS else "transposed"
    V = (TINY.vocab_size, TINY.dim)
    dev = tuned(Forms({(*V, b): (form, b) for b in BUCKETS}))
    medusa = Medusa(Heads(TINY.dim, TINY.vocab_size, 2).init_from(model.lm_head), [(0,), (0, 0)])
    ref = generate(model, [1, 2, 3], max_new_tokens=8, eos_id=-1).tokens
    assert generate(model, [1, 2, 3], medusa, max_new_tokens=8, eos_id=-1, dev=dev).tokens == ref
    twin = copy.deepcopy(medusa)
    assert twin.heads.proj[0] is not medusa.heads.proj[0]
    assert generate(model, [1, 2, 3], twin, max_new_tokens=8, eos_id=-1, dev=dev).tokens == ref
    assert {(id(m.heads.proj[0].weight), form) for m in (medusa, twin)} <= set(dev.forms.prepared)
