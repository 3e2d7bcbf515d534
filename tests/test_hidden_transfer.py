"""Hidden Transfer: exactness, real rows untouched by pseudo rows, the training attention of
section 3.3, the trainer's packed forward against decoding, and training."""
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import check_exact, descend, each_dtype, model_args, one_forward, random_model
from nanospec import NanospecError
from nanospec.methods.hidden_transfer import HiddenTransfer, Transfer, batches, kl_loss, pack, pseudo_states
from nanospec.model import ModelArgs
from nanospec.training.forced import labelled
from nanospec.tree import Template, Tree, choose_tree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY = ModelArgs(dim=24, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)
ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]


def random_transfer(dim, layers, seed, noise=0.3, dtype=torch.float32, device="cpu"):
    """Identity maps plus noise: pseudo states that draft something, sometimes right."""
    torch.manual_seed(seed)
    tr = Transfer(dim, layers)
    with torch.no_grad():
        for W in tr.W:
            W.add_(torch.randn_like(W) * noise)
    return tr.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), n_layers=st.integers(2, 4), seed=st.integers(0, 2**16), plen=st.integers(1, 24),
       data=st.data(), tree_size=st.integers(1, 12), chained=st.booleans(), sampled=st.booleans())
def test_hidden_transfer_equals_ar(device, dtype, args, n_layers, seed, plen, data, tree_size, chained, sampled):
    args = dataclasses.replace(args, n_layers=n_layers)
    layers = sorted(data.draw(st.sets(st.integers(1, n_layers - 1), min_size=1, max_size=3)))
    model = random_model(args, seed, DTYPES[dtype], device)
    tr = random_transfer(args.dim, layers, seed, dtype=DTYPES[dtype], device=device)
    d = HiddenTransfer(tr, choose_tree(ACC[:len(layers)], tree_size), chained)
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 20, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    # the pseudo states' candidates carry the truth: the layer loop runs on accepted drafts
    assert out.tokens_per_step >= 1.5


def test_real_rows_never_see_pseudo_rows():
    """Tree rows' logits are bitwise those of the tree alone, in exact mode."""
    model = random_model(TINY, 1)
    d = HiddenTransfer(random_transfer(TINY.dim, [1, 2], 1), choose_tree(ACC[:2], 6))
    tree = Template([(0,), (1,), (0, 0), (0, 1), (1, 0)]).tree(5, torch.tensor([[1, 2], [3, 4]]))
    prompt = [3, 9, 4, 1, 7]
    with_pseudo, pseudo = one_forward(model, d, tree, prompt, exact=True)
    alone, _ = one_forward(model, d, tree, prompt, exact=True, plain=True)
    assert pseudo.shape[:2] == (len(tree), 2) and torch.equal(with_pseudo, alone)


def test_pseudo_rows_join_at_their_layer():
    """Fast mode adds pseudo rows at layer t_i; exact mode runs placeholders from layer 0 and
    overwrites them. Both compute the same pseudo states (up to rounding)."""
    model = random_model(TINY, 2)
    d = HiddenTransfer(random_transfer(TINY.dim, [1, 2], 2), choose_tree(ACC[:2], 6))
    tree = Template([(0,), (1,), (0, 0), (0, 1)]).tree(5, torch.tensor([[1, 2], [3, 4]]))
    exact = one_forward(model, d, tree, [3, 9, 4, 1, 7], exact=True)[1]  # the pseudo rows' logits
    fast = one_forward(model, d, tree, [3, 9, 4, 1, 7], exact=False)[1]
    torch.testing.assert_close(fast, exact, atol=1e-4, rtol=1e-4)


def test_training_attention_matches_section_3_3():
    """Sequence of 6 tokens, prompt of 3, k=2: hosts j=2..5; pseudo (i, j) stands for token
    j+i, sits at position j+i and sees real rows 0..j+i-1 and itself (paper); real rows 0..j,
    its chain's earlier pseudo states and itself (chain); real rows 0..j and itself (masked)."""
    tokens, pos, vis, hosts, valid, teacher, label = pack([[5, 6, 7, 8, 9, 10]], [3], 2, "paper")
    assert hosts[0].tolist() == [2, 3, 4, 5]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5] + [3, 4, 5, 6] + [4, 5, 6, 7]
    assert valid[0].tolist() == [[True, True, True, False], [True, True, False, False]]
    assert teacher[0, 0, :3].tolist() == [3, 4, 5] and label[0, 0, :2].tolist() == [9, 10]
    expected = {  # pseudo row -> the rows it sees
        "paper": {6: [0, 1, 2, 6], 7: [0, 1, 2, 3, 7], 10: [0, 1, 2, 3, 10], 11: [0, 1, 2, 3, 4, 11]},
        "chain": {6: [0, 1, 2, 6], 7: [0, 1, 2, 3, 7], 10: [0, 1, 2, 6, 10], 11: [0, 1, 2, 3, 7, 11]},
        "masked": {6: [0, 1, 2, 6], 7: [0, 1, 2, 3, 7], 10: [0, 1, 2, 10], 11: [0, 1, 2, 3, 11]},
    }
    for attention, rows in expected.items():
        vis = pack([[5, 6, 7, 8, 9, 10]], [3], 2, attention)[2][0]
        assert torch.equal(vis[:6, :6], torch.ones(6, 6).tril().bool())  # real rows: causal, see no pseudo row
        for r, seen in rows.items():
            assert vis[r].nonzero()[:, 0].tolist() == seen, (attention, r)


def test_training_forward_matches_decoding():
    """The packed, cache-free forward with the chain attention gives decoding's pseudo logits."""
    model = random_model(TINY, 3)
    tr = random_transfer(TINY.dim, [1, 2], 3)
    seq = [1, 5, 7, 9, 3, 4, 8, 2, 6, 11]
    tokens, pos, vis, hosts, *_ = pack([seq], [4], 2, "chain")
    h = pseudo_states(model, tr, tokens, pos, vis, hosts)
    T, H = len(seq), hosts.shape[1]
    packed = model.lm_head(h[0, T:]).view(2, H, -1)
    for n, j in enumerate(hosts[0].tolist()):
        d = HiddenTransfer(tr, choose_tree(ACC[:2], 4))
        pseudo = one_forward(model, d, Tree.chain(seq[j]), seq[:j + 1], exact=False)[1]
        torch.testing.assert_close(pseudo[0], packed[:, n], atol=1e-4, rtol=1e-4)


def test_a_few_training_steps_reduce_the_loss():
    model = random_model(TINY, 4)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    data = [labelled((torch.randint(0, 37, (4,), generator=g).tolist(), [7, 8, 9, 10] * 4)) for _ in range(8)]
    tr = Transfer(TINY.dim, [1, 2])
    tokens, pos, vis, hosts, valid, teacher, _ = next(batches(data, 2, "paper", 4, torch.Generator().manual_seed(0), 1))
    loss = lambda: kl_loss(model, pseudo_states(model, tr, tokens, pos, vis, hosts), valid, teacher)[0]
    before, after = descend(loss, tr.parameters(), 3e-3, 20)
    assert after < 0.8 * before


def test_steps_train_separately_under_the_paper_mask():
    """Under the paper's mask, step i's loss reaches W_i alone: joint training is separate training."""
    model = random_model(TINY, 5)
    tr = random_transfer(TINY.dim, [1, 2], 5)
    g = torch.Generator().manual_seed(1)
    data = [labelled((torch.randint(0, 37, (3,), generator=g).tolist(),
                      torch.randint(0, 37, (6,), generator=g).tolist()))]
    tokens, pos, vis, hosts, valid, teacher, _ = next(batches(data, 2, "paper", 1, torch.Generator().manual_seed(0), 1))
    _, per_step = kl_loss(model, pseudo_states(model, tr, tokens, pos, vis, hosts), valid, teacher)
    per_step[1].backward()
    assert tr.W[0].grad is None or not tr.W[0].grad.any()
    assert tr.W[1].grad.abs().sum() > 0


def test_bad_configurations_are_refused():
    with pytest.raises(NanospecError, match="t_1 < t_2"):
        Transfer(8, [3, 2])
    with pytest.raises(NanospecError, match=r"in 1\.\.2"):
        Transfer(8, [1, 3]).check(3)
    with pytest.raises(NanospecError, match="deep"):
        HiddenTransfer(Transfer(8, [1]), [(0,), (0, 0)])
