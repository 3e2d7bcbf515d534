"""BiTA: exactness of every decoding variant and prompting, the attention contract of Figure 3,
the trainer's packed forward against decoding, tree shapes and training."""
import argparse
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import check_exact, each_dtype, model_args, one_forward, random_model
from nanospec import NanospecError
from nanospec.io.checkpoint import load
from nanospec.methods.bita import BiTA, Tuning, batches, pack, sar_logits, sar_loss
from nanospec.model import ModelArgs
from nanospec.training.forced import labelled, targets
from nanospec.tree import Template, Tree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
W = Path(__file__).resolve().parents[1] / "weights" / "pylm"
TINY = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)


def random_tuning(args, seed, M, P, prompting, dtype, device, scale=1.0):
    torch.manual_seed(seed)
    tune = Tuning(args, M, P, prompting)
    with torch.no_grad():
        for p in tune.parameters():
            p.mul_(scale / 0.02)  # large embeddings: masks whose outputs vary, prompts that matter
    return tune.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 24), data=st.data(),
       P=st.integers(1, 5), prompting=st.sampled_from(["deep", "shallow", "none"]),
       decoding=st.sampled_from(["efficient", "full", "straight"]), k=st.integers(1, 3), sampled=st.booleans())
def test_bita_equals_ar(device, dtype, args, seed, plen, data, P, prompting, decoding, k, sampled):
    # straightforward decoding with one mask drafts every other step at best (its mask is used up), so M >= 2 there
    M = data.draw(st.integers(2 if decoding == "straight" else 1, 3))
    model = random_model(args, seed, DTYPES[dtype], device)
    d = BiTA(random_tuning(args, seed, M, P, prompting, DTYPES[dtype], device), decoding, k)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 20, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.tokens_per_step >= 1.5  # the mask rows' candidates carry the truth: drafts are accepted


@pytest.mark.parametrize("prompting", ["deep", "shallow"])
def test_tree_rows_never_see_prompt_or_mask_rows(prompting):
    """Figure 3: ordinary rows' outputs are bitwise those of the tree alone, in exact mode."""
    model = random_model(TINY, 1)
    d = BiTA(random_tuning(TINY, 1, 3, 4, prompting, torch.float32, "cpu"), "efficient", 2)
    tree = Template([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)]).tree(5, torch.tensor([[1, 2], [3, 4], [6, 7]]))
    prompt = [3, 9, 4, 1]
    with_masks, masks = one_forward(model, d, tree, prompt, exact=True)
    alone, _ = one_forward(model, d, tree, prompt, exact=True, plain=True)
    assert masks.shape[:2] == (len(tree), 3) and torch.equal(with_masks, alone)


@pytest.mark.parametrize("prompting", ["deep", "shallow", "none"])
def test_training_forward_matches_decoding(prompting):
    """The trainer's packed, cache-free forward gives the mask logits decoding computes."""
    model = random_model(TINY, 2)
    tune = random_tuning(TINY, 2, 3, 4, prompting, torch.float32, "cpu", scale=0.5)
    seq = [1, 5, 7, 9, 3, 4, 8, 2, 6, 11, 12, 30, 31]
    tokens, kind, pos, vis, lab = pack([labelled((seq[:4], seq[4:]))], 3, 4, tune.P, prompting == "shallow",
                                       torch.Generator().manual_seed(0))
    packed = sar_logits(model, tune, tokens, kind, pos, vis)[0].view(4, 3, -1)
    splits = (pos[0, kind[0] >= 1].view(4, 3)[:, 0] - 1).tolist()
    for g, k in enumerate(splits):
        d = BiTA(tune, "straight", 1)
        masks = one_forward(model, d, Tree.chain(seq[k]), seq[:k + 1], exact=False)[1]
        torch.testing.assert_close(masks[0], packed[g], atol=1e-4, rtol=1e-4)
        assert lab[0, 3 * g].item() == seq[k + 2]  # mask 0 of a group at k predicts token k+2


def test_mask_labels_are_the_models_own_tokens_where_known():
    """On teacher-forced text, mask i of a group at k is labelled with the model's token k+2+i only while the text
    went on as the model would (training/forced.targets); elsewhere -100."""
    tokens, labels = [5, 6, 7, 8, 9, 10, 11, 12], [6, 7, 1, 9, 10, 2, 12, 13]  # leaves the model's path after 2, 5
    tune = Tuning(TINY, 3, 2, "deep")
    _, kind, pos, _, lab = pack([(tokens, labels)], 3, 6, tune.P, False, torch.Generator().manual_seed(0))
    want = targets(tokens, labels, 3)
    for g, k in enumerate((pos[0, kind[0] >= 1].view(6, 3)[:, 0] - 1).tolist()):
        assert lab[0, 3 * g:3 * g + 3].tolist() == want[k].tolist()
    assert (lab == -100).any() and (lab >= 0).any()


def test_draft_tree_shapes():
    cands = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tune = Tuning(TINY, 3, 2, "deep")

    class Dec:
        root = 5
    eff, full, straight = (BiTA(tune, v, 3) for v in ("efficient", "full", "straight"))
    draft = lambda d: d.draft(Dec, cands, d.template, None)
    t = draft(eff)
    assert len(t) == 1 + 9 == len(eff.template)
    kids = [sum(p == i for p in t.parents) for i in range(len(t))]
    assert kids == [3, 3, 0, 0, 3, 0, 0, 0, 0, 0]  # only top-1s have children
    assert len(draft(full)) == 1 + 3 + 9 + 27
    assert draft(straight).tokens.tolist() == [5, 10, 20, 30]
    assert eff.max_rows == 10 + 10 * 3 and straight.max_rows == 4 + 3
    assert eff.rows(4) == 4 + 4 * 3 and straight.rows(4) == 4 + 3


def test_straightforward_drops_used_masks():
    """After c accepted drafts, the root group's masks c.. give the next drafts (Figure 4): a node
    at depth c of the root's chain carries masks c.. as its drafts, and M - c of them are real."""
    model = random_model(TINY, 4)
    d = BiTA(random_tuning(TINY, 4, 3, 2, "none", torch.float32, "cpu"), "straight", 1)
    tree = Tree.chain(5, [6, 7, 8])
    _, drafts = one_forward(model, d, tree, [3, 9, 4, 1], exact=False)
    _, root = one_forward(model, d, Tree.chain(5), [3, 9, 4, 1], exact=False)
    for c in range(4):
        torch.testing.assert_close(drafts[c, :3 - c], root[0, c:], atol=1e-5, rtol=1e-5)


def test_a_few_training_steps_reduce_the_sar_loss():
    model = random_model(TINY, 3)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    data = [labelled((torch.randint(0, 37, (4,), generator=g).tolist(), [7, 8, 9, 10] * 4)) for _ in range(8)]
    args = argparse.Namespace(batch_size=4, masks=3, groups=6)
    tune = Tuning(TINY, 3, 4, "deep")
    opt = torch.optim.AdamW(tune.parameters(), lr=3e-2)
    fixed = next(batches(data, args, tune.P, False, torch.Generator().manual_seed(0), 1))

    @torch.no_grad()
    def loss():
        return float(sar_loss(sar_logits(model, tune, *fixed[:4]), fixed[4], 3))
    before = loss()
    for b in batches(data, args, tune.P, False, torch.Generator().manual_seed(1), 30):
        sar_loss(sar_logits(model, tune, *b[:4]), b[4], 3).backward()
        opt.step()
        opt.zero_grad()
    assert loss() < before - 1.0


def test_bad_options_are_refused():
    model = load(W)
    for kw in (dict(decoding="fast"), dict(prompting="wide"), dict(k=0)):  # one error line each
        with pytest.raises(NanospecError):
            BiTA.load(model, W, **kw)
