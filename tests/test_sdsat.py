"""SDSAT: standard rows are the base model's bitwise whatever the adaptive rows' update, exactness
against AR of the base model, the two-step loop, section 2.2's windows, and training."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import check_exact, descend, each_dtype, model_args, noisy, peek, random_model
from nanospec import NanospecError
from nanospec.cache import Block, KVCache
from nanospec.engine import Decoding, generate, lay_out
from nanospec.forward import Forward
from nanospec.methods.sdsat import SDSAT, Delta, adaptive_logits, adaptive_rows, starts
from nanospec.model import ModelArgs
from nanospec.training.forced import targets
from nanospec.tree import Tree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)


def delta_for(model, seed, tokens=1, rank=4):
    """A delta that changes adaptive rows a lot: every factor random, on the model's device and dtype."""
    return noisy(Delta(model, rank, tokens), seed, 0.3).to(model.embed.weight)


def interleaved(model, adaptive: torch.Tensor, delta, seed: int, planted: str = ""):
    """Logits (T, V) of one exact-mode block whose rows are adaptive where `adaptive` (T,) says:
    a standard row sees the standard rows up to itself, an adaptive row every row up to itself.
    delta None: the block without the delta (adaptive rows then run the base weights)."""
    T, device = len(adaptive), model.embed.weight.device
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.args.vocab_size, (1, T), generator=g).to(device)
    t = torch.arange(T)
    sees = (t[None] <= t[:, None]) & (adaptive[:, None] | ~adaptive[None])  # (row, key)
    if planted == "standard sees adaptive":
        sees = t[None] <= t[:, None]
    extra = torch.stack([F.pad(row.nonzero()[:, 0], (0, T - int(row.sum())), value=-1) for row in sees])
    zero = torch.zeros(1, T, dtype=torch.long, device=device)
    block = Block(tokens, t[None].to(device), t.to(device), zero, extra[None].to(device))
    cache = KVCache.for_model(model, T + 1)
    f = Forward.on_cache(model, block, cache, exact=True)
    x = f.embed()
    rows = adaptive.nonzero()[:, 0].to(device)
    if delta is None:
        return f.logits(f.norm(f.layers(x)), T)[0]
    x[:, rows] = delta.embed[0].to(x.dtype)
    on = delta.on(None if planted == "delta on every row" else rows)
    return f.logits(f.norm(f.layers(x, delta=on)), T)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@given(args=model_args(), seed=st.integers(0, 2**16), pattern=st.lists(st.booleans(), min_size=2, max_size=24))
def test_standard_rows_are_bitwise_the_base_models(device, dtype, args, seed, pattern):
    """The update's promise: with and without the delta, every standard row's logits are the same
    bits, over random tiny models and random interleavings of adaptive rows (exact mode)."""
    model = random_model(args, seed, DTYPES[dtype], device)
    adaptive = torch.tensor(pattern)
    with torch.inference_mode():
        delta = delta_for(model, seed)
        on, off = interleaved(model, adaptive, delta, seed), interleaved(model, adaptive, None, seed)
    assert torch.equal(on[~adaptive.to(on.device)], off[~adaptive.to(on.device)])
    if adaptive.any():  # and the delta does change the adaptive rows
        assert not torch.equal(on[adaptive.to(on.device)], off[adaptive.to(on.device)])


@pytest.mark.parametrize("planted", ["delta on every row", "standard sees adaptive"])
def test_planted_faults_change_standard_rows(planted):
    """The property test can fail: a delta that reaches standard rows, or a standard row that sees
    an adaptive row, changes their bits."""
    model = random_model(TINY, 5)
    adaptive = torch.tensor([False, True, False, False, True, True, False, False])
    with torch.inference_mode():
        delta = delta_for(model, 5)
        on = interleaved(model, adaptive, delta, 5, planted)
        off = interleaved(model, adaptive, None, 5)
    assert not torch.equal(on[~adaptive], off[~adaptive])


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 24), k=st.integers(1, 5),
       width=st.integers(1, 3), diverse=st.booleans(), sampled=st.booleans())
def test_sdsat_equals_ar(device, dtype, args, seed, plen, k, width, diverse, sampled):
    """Every standard token is the base model's: SDSAT's output is the base model's AR, bitwise."""
    model = random_model(args, seed, DTYPES[dtype], device)
    d = SDSAT(delta_for(model, seed, tokens=k if diverse else 1), k, width)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 20, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.tokens_per_step >= 1.5  # the adaptive tokens' candidates carry the truth: drafts are accepted


def test_two_step_loop():
    """Step 1 is the root and k adaptive rows; a fully accepted chain drafts the next one from its
    adaptive rows (no step 1 in between); a partly accepted one goes back to step 1."""
    model = random_model(TINY, 3)
    prompt, k = [5, 9, 2, 7], 3
    ar = generate(model, prompt, max_new_tokens=40, eos_id=-1)
    d = peek(SDSAT(delta_for(model, 3), k=k), ar.tokens, p=0.6, seed=1)
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
    wide = SDSAT(delta_for(model, 3), k=3, width=2)
    t = wide.template.tree(9, torch.tensor([[11, 15], [12, 16], [13, 17]]))
    kids = [sum(p == i for p in t.parents) for i in range(len(t))]
    assert len(t) == 1 + 6 and kids[:2] == [2, 2]  # only top-1s branch


def test_window_statistics():
    """About `rate` of the positions (never 0) start a window, of a length uniform on 1..L."""
    g = torch.Generator().manual_seed(0)
    L, rate, T = 5, 0.1, 500
    wins = [w for _ in range(400) for w in starts(T, L, rate, g)]
    assert all(0 < s < T for s, _ in wins)
    assert abs(len(wins) / (400 * (T - 1)) - rate) < 0.005
    counts = torch.bincount(torch.tensor([n for _, n in wins]), minlength=L + 1)[1:].float()
    assert (counts / counts.mean() - 1).abs().max() < 0.06, counts
    assert {n for _, n in starts(T, L, rate, g, full=True)} == {L}


def test_adaptive_rows_see_what_inference_shows_them():
    """Row j of a window at s sits at s+j, sees standard keys 0..s-1 and its window's rows 0..j,
    and is labelled with the token at s+j+1 (-100 past the end); diverse rows take embedding j."""
    x = torch.arange(10, 20)[None]  # T = 10
    which, pos, vis, lab = adaptive_rows(x, [[(3, 2), (8, 3)]], diverse=True)
    assert which.tolist() == [[0, 1, 0, 1, 2]] and pos.tolist() == [[3, 4, 8, 9, 10]]
    assert lab.tolist() == [[14, 15, 19, -100, -100]]
    T = 10
    assert vis[0, :2, :T].sum(-1).tolist() == [3, 3] and vis[0, 2:, :T].sum(-1).tolist() == [8, 8, 8]
    assert vis[0, :, T:].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                            [0, 0, 1, 1, 1]]


def test_adaptive_rows_take_the_models_own_tokens_where_given():
    """With `ahead` (training/forced.targets over teacher-forced text), row j of a window at s is labelled with the
    model's own token j+2 after s-1, -100 where the text left the model's path before it."""
    tokens, labels = [5, 6, 7, 8, 9, 10], [6, 7, 1, 9, 10, 2]
    ahead = targets(tokens, labels, 3)
    *_, lab = adaptive_rows(torch.tensor([tokens]), [[(1, 3), (3, 2)]], False, ahead[None])
    assert lab.tolist() == [[7, 1, -100, -100, -100]] == [ahead[0].tolist() + ahead[2, :2].tolist()]


def test_adaptive_rows_match_decoding_and_training_lowers_their_loss():
    """The training forward (frozen keys, adaptive rows apart) gives an adaptive row the logits
    decoding gives it, and a few steps on the delta lower the adaptive rows' loss."""
    model = random_model(TINY, 2)
    for p in model.parameters():
        p.requires_grad_(False)
    delta = delta_for(model, 2)
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4] * 2)
    with torch.no_grad():  # one window after position 5: decoding's step 1 at the root x[5]
        logits, _ = adaptive_logits(model, delta, x[:1, :7], [[(6, 3)]], diverse=False)
        d = SDSAT(delta, k=3)
        dec = Decoding(model, KVCache.for_model(model, 16), False, 8, x[0, :6].tolist())
        dec.prefill(dec.prompt[:-1])
        block, nodes, cache_rows = lay_out([dec], d, [Tree.chain(dec.root)])
        out = d.forward(Forward.on_cache(model, block, dec.cache, False, cache_rows), nodes)
    assert torch.allclose(out.draft_inputs[0, 0], logits[0], atol=1e-3)
    wins = [[(s, 4) for s in range(1, 28, 3)]] * 2
    loss = lambda: F.cross_entropy(*(t.flatten(0, 1) if t.dim() == 3 else t.flatten()
                                     for t in adaptive_logits(model, delta, x, wins, False)))
    before, after = descend(loss, delta.parameters(), 3e-2, 30)
    assert after < 0.5 * before


def test_errors():
    model = random_model(TINY, 1)
    with pytest.raises(NanospecError, match="diverse"):
        SDSAT(Delta(model, 2, 3), k=5)
    with pytest.raises(NanospecError, match="at least 1"):
        SDSAT(Delta(model, 2, 1), k=0)


class EveryThirdAR:
    """A planner stand-in: every third step an AR step (a budget of 0), the others the drafter's whole chain."""

    def __init__(self, k):
        self.k, self.n = k, 0

    def start(self, drafter, dec):
        pass

    def budget(self, live):
        self.n += 1
        return (0 if self.n % 3 == 0 else self.k), None

    def observe(self, *step):
        pass

    def report(self):
        return ""


def test_report_counts_its_own_first_steps_not_the_planners_ar_steps():
    """A draft step 1 (the root alone, k adaptive rows) counts; an AR step, its tree the root alone too, does not."""
    model = random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, intermediate_size=48))
    d = SDSAT(noisy(Delta(model, 4), 5, 0.3), k=3)
    d.planner, steps = EveryThirdAR(3), []
    generate(model, [3, 14, 15, 9, 2, 6], d, max_new_tokens=30, eos_id=-1, on_step=lambda dec, s: steps.append(s))
    own = sum(len(s.tree) == 1 and s.budget != 0 for s in steps)
    assert own > 0 and sum(s.budget == 0 for s in steps) > 0
    assert d.draft_only == own and f"{own} draft-step-1 forwards" in d.report()
