"""Exact mode's CPU layout. A CPU's BLAS takes alignment-dependent paths, and its elementwise kernels finish a
thread's run of SIMD chunks on a scalar path, so a row's bits could depend on where the row sits. Exact mode lays
every product's rows out 64-byte aligned (devices.CPU.aligned) and runs silu, cos and sin row-wise
(devices.CPU.elementwise).
Whether a host shows the difference depends on its CPU, so two stand-ins make such a CPU of any machine:
AlignedProducts and ScalarRemainders. Under them exact mode keeps AR's bits, and without either construction it does
not."""
import pytest
import torch
import torch.nn.functional as F

from helpers import ARGS, PRODUCT_FORMS, Adversary, AlignedProducts, ScalarRemainders, random_model, rows_by_index
from nanospec import devices
from nanospec.engine import generate, shapes
from nanospec.model import ModelArgs

# rows of odd length; SMALL's hidden rows (23) fit in 32 elements, so row-wise calls padded to 32 rather than 64 (two
# AVX-512 vectors of bf16) would leave a bf16 remainder
SMALL = ModelArgs(dim=19, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=10, vocab_size=41, intermediate_size=23)
ROWS = [(ARGS, 0, 20), (SMALL, 1, 37)]  # (model args, seed, rows of the block)
DTYPES = [torch.float32, torch.bfloat16]
STAND_INS = {"aligned": AlignedProducts, "rowwise": ScalarRemainders}  # the construction each stand-in proves
IDENTITY = {"aligned": ("aligned", lambda self, x: x), "rowwise": ("elementwise", lambda self, fn, x: fn(x))}


@pytest.fixture
def without(monkeypatch):
    """without(name): exact mode with the named construction of the layout made the identity (a planted fault)."""
    return lambda name: monkeypatch.setattr(devices.CPU, *IDENTITY[name])


def misaligned(x):
    """x's values in a buffer one element later: rows that started on a 64-byte boundary start off it."""
    return torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", PRODUCT_FORMS)
def test_the_alignment_stand_in_moves_a_misaligned_rows_bits(form, dtype):
    """In every form of a product: aligned rows give the host's product; the same rows one element later give
    other last bits, the same on every call; rows of odd length, aligned or not by their index, make a row's
    bits depend on its index."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((4, 16, 96), (80, 96), (4, 16, 80)))
    product = PRODUCT_FORMS[form]
    with AlignedProducts():
        aligned, moved, again = product(x, w, b), product(misaligned(x), w, b), product(misaligned(x), w, b)
        odd = x[..., :95].contiguous()  # 380 bytes a row (bf16: 190): only some rows start aligned
        rev = product(odd.flip(1), w[:, :95], b)
        fwd = product(odd, w[:, :95], b)
    assert torch.equal(aligned, product(x, w, b)) and torch.equal(moved, again)
    assert not torch.equal(moved, aligned)
    assert not torch.equal(rev.flip(1), fwd)
    assert (moved.float() - aligned.float()).abs().max() < 0.02 * aligned.float().abs().max()  # still the product


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [F.silu, torch.cos, torch.sin])
def test_the_simd_stand_in_moves_the_bits_of_a_runs_remainder(fn, dtype):
    """An element past a run's last whole SIMD chunk lands one ulp above the host's kernel, in the call's last
    elements and at the end of each thread's run in a call over more than one; the other elements are the host's."""
    for n in (1000, 3 * ScalarRemainders.GRAIN + 100):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        with ScalarRemainders():
            y = fn(x)
        plain, scalar = fn(x), ScalarRemainders.scalar(n, x.element_size())
        assert torch.equal(y[~scalar], plain[~scalar])
        assert torch.equal(y[scalar], torch.nextafter(plain[scalar], plain.new_tensor(torch.inf)))
        ends = scalar[1:] < scalar[:-1]  # a scalar element followed by a SIMD one: a run's end inside the call
        assert scalar[-1] and bool(ends.any()) == (n > ScalarRemainders.GRAIN)
    remainder = ScalarRemainders.scalar
    assert not remainder(ScalarRemainders.GRAIN, 2).any() and not remainder(64 * 37, 4).any()  # rowwise's calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", STAND_INS)
def test_exact_rows_do_not_depend_on_their_index_on_such_a_cpu(name, dtype):
    """Exact mode's premise (helpers.rows_by_index) under each stand-in, for rows of odd lengths in fp32 and bf16."""
    with STAND_INS[name]():
        for args, seed, T in ROWS:
            rows_by_index(random_model(args, seed, dtype), seed, T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", STAND_INS)
def test_without_the_layout_a_rows_bits_follow_its_index_on_such_a_cpu(name, dtype, without):
    """The test above catches the layout's construction removed, on any machine."""
    without(name)
    for args, seed, T in ROWS:
        with STAND_INS[name](), pytest.raises(AssertionError, match="depend on its index"):
            rows_by_index(random_model(args, seed, dtype), seed, T)


PROMPT = [3, 9, 4, 1, 7, 12, 5] * 2


def tree_and_ar(model, prompt: list[int], n: int = 16):
    """Exact mode's AR and an adversarial drafter's trees after prompt, at shared shapes: both outputs."""
    Q, S, W = shapes([Adversary([], 1, extra_rows=3)], len(prompt), n)
    kw = dict(max_new_tokens=n, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True)
    ar = generate(model, prompt, **kw)
    return ar, generate(model, prompt, Adversary(ar.tokens, model.args.vocab_size, 1, extra_rows=3), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_trees_logits_are_ars_under_alignment_dependent_products(dtype):
    """A node's row sits at another index of the block, so at another address, than AR's row of its position:
    aligned rows make both the host's product."""
    with AlignedProducts():
        ar, tree = tree_and_ar(random_model(SMALL, 3, dtype), PROMPT)
    assert tree.tokens == ar.tokens and tree.steps < ar.steps
    assert torch.equal(tree.logits, ar.logits), "logits of accepted positions differ from AR's"


def test_without_aligned_rows_a_trees_logits_move_under_such_products(without):
    without("aligned")
    with AlignedProducts():
        ar, tree = tree_and_ar(random_model(SMALL, 3), PROMPT)
    assert tree.steps < ar.steps and not torch.equal(tree.logits, ar.logits)
