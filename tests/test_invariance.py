"""A row's bits must not depend on its product's total rows. cuBLAS picks its fp32 kernel by them:
on an H100 a sequence's logits inside a batch moved by one ulp from the same sequence alone.
RowCountProducts stands in for such a library on the CPU. Under it the construction of live blocks
only (each live sequence's Q rows: the CPU default) lets a sequence's bits move with its batch,
and the block batch (block_batch=N: every exact forward runs N sequences' blocks, idle ones padded;
the CUDA default) keeps them AR's alone, for every method, in fp32 and bf16, wherever the sequence
sits in the block."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import (
    ARGS,
    FAMILIES,
    METHODS,
    PRODUCT_FORMS,
    RowCountProducts,
    call,
    check_batch,
    decode_main,
    drafter,
    each_method,
    family_args,
    random_model,
)
from nanospec import NanospecError
from nanospec.devices import CUDA
from nanospec.engine import generate, shapes
from nanospec.sizes import block_batch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", PRODUCT_FORMS)
def test_the_stand_in_moves_a_rows_bits_with_the_total_rows(form, dtype):
    """The detector detects, in every form of a product: an item of a batch of 4 and the same item alone differ
    in their last bits (a batched product's rows are all its items' rows, not one matrix's)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((4, 16, 96), (80, 96), (4, 16, 80)))
    product = PRODUCT_FORMS[form]
    with RowCountProducts():
        batched, single, again = product(x, w, b), product(x[:1], w, b[:1]), product(x.clone(), w, b)
    assert not torch.equal(batched[0], single[0])
    assert torch.equal(batched, again)  # a function of the rows and their count, not of chance
    ref = product(x.float(), w.float(), b.float())
    assert (batched.float() - ref).abs().max() < 0.02 * ref.abs().max()  # still the product, to its dtype's precision


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["ar", "medusa"])
def test_live_blocks_alone_move_with_the_batch_under_such_products(name, dtype):
    """The CPU default's construction, under the stand-in: a sequence of a batch of 4 is not AR alone."""
    model = random_model(ARGS, seed=2, dtype=dtype)
    prompts = [[3, 9, 4, 1], [8, 2, 6, 10, 11], [4, 4], [7, 1, 7]]
    with RowCountProducts(), pytest.raises(AssertionError, match=r"sequence \d"):
        check_batch(model, prompts, drafter(name, model), 12, peeking=0.9)


prompt_lists = st.lists(st.lists(st.integers(0, ARGS.vocab_size - 1), min_size=1, max_size=12), min_size=2, max_size=6)


@pytest.mark.parametrize("name", METHODS)
@each_method(20)
@given(prompts=prompt_lists, n=st.integers(1, 16), seed=st.integers(0, 6), dtype=st.sampled_from(DTYPES),
       rows=st.none() | st.integers(1, 4), sampled=st.booleans(), family=st.sampled_from(FAMILIES))
def test_a_block_batch_keeps_each_sequence_as_alone_under_such_products(name, prompts, n, seed, dtype, rows, sampled,
                                                                        family):
    """Up to 4 sequences at once (refills when there are more prompts than rows), every forward 4
    sequences' blocks: each sequence, at whichever cache row it lands, is bitwise AR alone. Any family."""
    model = random_model(family_args(ARGS, family), seed=seed, dtype=dtype)
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else None
    with RowCountProducts():
        check_batch(model, prompts[:4] if rows is None else prompts, drafter(name, model, seed), n,
                    peeking=0.9, seed=seed, sampling=sampling, rows=rows, block_batch=4)


def test_a_block_batch_is_what_cuda_runs_by_default():
    """Exact mode on CUDA: batches of up to 8 sequences run 8 blocks (so each is bitwise alone), larger
    ones the next multiple of 8; a CPU runs the live blocks only unless asked; fast mode has no blocks."""
    assert [block_batch(None, b, True, "cuda") for b in (1, 5, 8, 9, 17)] == [8, 8, 8, 16, 24]
    assert block_batch(None, 4, True, "cpu") is None and block_batch(None, 4, False, "cuda") is None
    assert block_batch(6, 4, True, "cpu") == 6 and CUDA.block_batch == 8
    with pytest.raises(NanospecError, match="smaller than the batch"):
        block_batch(2, 3, True, "cpu")
    with pytest.raises(NanospecError, match="exact mode"):
        block_batch(2, 1, False, "cpu")


def test_a_lone_sequence_runs_the_whole_block(monkeypatch):
    """Every exact forward, prefill included, of a lone sequence with block_batch=3 runs 3 x Q rows."""
    from nanospec import forward
    model = random_model(ARGS, seed=1)
    shapes_seen, on_cache = set(), forward.Forward.on_cache.__func__

    def spy(cls, model, block, *a, **k):
        shapes_seen.add(tuple(block.tokens.shape))
        return on_cache(cls, model, block, *a, **k)
    monkeypatch.setattr(forward.Forward, "on_cache", classmethod(spy))
    Q, S, W = shapes([drafter("medusa", model)], 20, 8)
    generate(model, list(range(1, 21)), drafter("medusa", model), max_new_tokens=8, exact=True, Q=Q,
             n_slots=S, block_batch=3)
    assert shapes_seen == {(3, Q)}


def test_block_batch_on_the_command_line(weights, tmp_path):
    code, out, err = call(decode_main, "--weights", weights, "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
                          "--mode", "exact", "--block-batch", "3", "--method", "ar", "--check")
    assert code == 0 and "identical" in err
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f"}\n{"prompt": "class A"}\n')
    for argv, msg in [(["--prompt-ids", "5,6", "--block-batch", "2"], "applies to exact mode"),
                      (["--prompt-ids", "5,6", "--mode", "exact", "--block-batch", "0"], "smaller than the batch"),
                      (["--prompts", tmp_path / "p.jsonl", "--mode", "exact", "--block-batch", "1", "--batch", "2"],
                       "--block-batch 1 is smaller than the batch of 2")]:
        code, _, err = call(decode_main, "--weights", weights, "--max-new-tokens", "4", *argv)
        assert code == 2 and msg in err and err.count("\n") == 1, err
