"""Medusa heads: init, tree choice, weights on disk, training, and exactness against AR."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import check_exact, each_dtype, model_args, noisy, random_model, run_cli
from nanospec import NanospecError
from nanospec.engine import generate
from nanospec.io.checkpoint import save, save_drafter
from nanospec.io.files import fingerprint
from nanospec.methods.medusa import Heads, Medusa, accuracy, draft_vocab, loss_fn, samples
from nanospec.model import ModelArgs
from nanospec.training.forced import labelled
from nanospec.tree import choose_tree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, intermediate_size=48)


def test_untrained_heads_repeat_the_next_token_guess():
    model = random_model(TINY)
    heads = Heads(32, 50, 3).init_from(model.lm_head)
    h = torch.randn(7, 32)
    out = heads(h)
    for k in range(3):
        assert torch.equal(out[k], model.lm_head(h))


def distinct_heads(model, shared: bool, token: bool) -> Heads:
    """Three heads that each draft something else: noisy blocks (and token maps, and own projections)."""
    a = model.args
    heads = Heads(a.dim, a.vocab_size, 3, model.lm_head if shared else None, base=model if token else None)
    return noisy(heads.init_from(model.lm_head), 0, 0.3)


@pytest.mark.parametrize("shared, token", [(False, False), (True, True)])
def test_depth_k_proposes_head_ks_logits(shared, token):
    """Medusa's proposals come in depth order: depth k (the token k + 1 after the next) is head k's block and
    projection applied to the node's state (token heads: and to the embedding of the token it emits next)."""
    model = random_model(TINY)
    heads = distinct_heads(model, shared, token)
    h = torch.randn(5, 32)
    e = model.embed(model.lm_head(h).argmax(-1))
    got = Medusa(heads, [(0,)]).propose(torch.stack([h, e], 1) if token else h[:, None])  # (B, K, V)
    for k in range(3):
        y = h + heads.tok[k](e) if token else h
        y = y + F.silu(heads.res[k](y))
        torch.testing.assert_close(got[:, k], (model.lm_head if shared else heads.proj[k])(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, seed=1)])
def test_a_steps_candidates_at_depth_k_are_its_proposals_at_depth_k(sampling):
    """The engine keeps the proposals' depth order: a step's candidates per depth are the top ranks of what the
    last step's accepted node proposed at that depth."""
    model = random_model(TINY)
    d = Medusa(distinct_heads(model, False, False), choose_tree([[0.5, 0.3, 0.2]] * 3, 8))
    proposed, drafted = [], []
    propose, draft = d.propose, d.draft
    d.propose = lambda drafts, *a: proposed.append(propose(drafts, *a)) or proposed[-1]
    d.draft = lambda dec, cands, *a: drafted.append(cands) or draft(dec, cands, *a)
    generate(model, [1, 2, 3], d, max_new_tokens=8, eos_id=-1, **sampling)
    assert drafted[0] is None and len(drafted) == len(proposed) > 3
    for logits, cands in zip(proposed, drafted[1:]):
        assert torch.equal(cands, logits[0].topk(cands.shape[1]).indices)


def test_choose_tree_by_path_probability():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.05]]
    assert choose_tree(acc, 4) == [(0,), (0, 0), (1,), (1, 0)]  # 0.25 * 0.5 beats 0.1
    assert choose_tree(acc, 6)[4:] == [(2,), (0, 1)]  # 0.1, then 0.6 * 0.1


@given(st.lists(st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3), min_size=1, max_size=4), st.integers(1, 30))
def test_chosen_trees_are_prefix_closed_and_parents_first(acc, size):
    paths = choose_tree(acc, size)
    assert len(paths) == min(size, sum(3 ** d for d in range(1, len(acc) + 1)))
    for i, p in enumerate(paths):
        assert len(p) == 1 or p[:-1] in paths[:i]


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 30), size=st.integers(1, 20),
       sampled=st.booleans(), layers=st.integers(1, 2), token=st.booleans(), narrow=st.booleans())
def test_exact_mode_logits_bitwise_equal_ar(device, dtype, args, seed, plen, size, sampled, layers, token, narrow):
    model = random_model(args, seed, DTYPES[dtype], device)
    torch.manual_seed(seed)
    V = args.vocab_size  # narrow: heads that share the lm_head and draft from half its tokens (--draft-vocab)
    heads = Heads(args.dim, V, 3, model.lm_head if narrow else None, layers, model if token else None,
                  V // 2 if narrow else 0)
    if narrow:
        heads.vocab.copy_(torch.randperm(V)[:V // 2].sort().values)
    heads.init_from(model.lm_head)  # drafts the next token...
    with torch.no_grad():
        heads.res[layers].weight.normal_()  # ...and, from head 2 (its first block) on, random guesses
        for m in heads.tok or []:
            m.weight.normal_()  # (token heads: that read the next token too)
    d = Medusa(heads.to(device=device, dtype=DTYPES[dtype]), choose_tree([[0.5, 0.3, 0.2]] * 3, size))
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    out = check_exact(model, prompt, d, 24, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.tokens_per_step >= 1.5  # the heads' candidates carry the truth (helpers.peek): drafts are accepted


def test_a_few_training_steps_reduce_the_loss():
    model = random_model(TINY)
    data = list(zip([[1, 2, 3], [4, 5], [6]] * 4,
                    [o.tokens for o in generate(model, [[1, 2, 3], [4, 5], [6]] * 4, max_new_tokens=16, eos_id=-1)]))
    h, y = samples(model, [labelled(d) for d in data], 3)
    heads = Heads(32, 50, 3).init_from(model.lm_head)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    first = loss_fn(heads(h), y).item()
    for _ in range(30):
        loss = loss_fn(heads(h), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.7 * first


def test_weights_for_another_base_model_are_refused(tmp_path):
    model, other = random_model(TINY, seed=0), random_model(TINY, seed=1)
    save(model, tmp_path)
    heads = Heads(32, 50, 2).init_from(model.lm_head)
    with pytest.raises(NanospecError, match="no medusa.safetensors"):
        Medusa.load(model, tmp_path)
    save_drafter(tmp_path / "medusa.safetensors", heads, {"base_fingerprint": fingerprint(other), "heads": 2,
                                                          "acc": [[0.5], [0.5]], "tree": [[0], [0, 0]]})
    with pytest.raises(NanospecError, match="trained for another base model"):
        Medusa.load(model, tmp_path)
    save_drafter(tmp_path / "medusa.safetensors", heads, {"base_fingerprint": fingerprint(model), "heads": 2,
                                                          "acc": [[0.5], [0.5]], "tree": [[0], [0, 0]]})
    assert Medusa.load(model, tmp_path).template.paths == [(0,), (0, 0)]


def test_stacked_heads_start_as_the_next_token_guess_and_keep_their_depth_on_disk(tmp_path):
    model = random_model(TINY)
    save(model, tmp_path)
    heads = Heads(32, 50, 2, model.lm_head, layers=3).init_from(model.lm_head)
    h = torch.randn(5, 32)
    assert torch.equal(heads(h), model.lm_head(torch.stack([h, h])))  # zero blocks: a stack repeats the guess
    with torch.no_grad():
        for r in heads.res:
            r.weight.normal_(std=0.3)
            r.bias.normal_(std=0.3)
    one = Heads(32, 50, 2, model.lm_head).init_from(model.lm_head)
    with torch.no_grad():
        for k in range(2):  # a one-block head with head k's first block differs from the stack
            one.res[k].load_state_dict(heads.res[3 * k].state_dict())
    assert not torch.allclose(one(h), heads(h))
    save_drafter(tmp_path / "medusa.safetensors", heads, {"base_fingerprint": fingerprint(model), "heads": 2,
                                                          "shared": True, "layers": 3, "acc": [[0.5], [0.5]],
                                                          "tree": [[0], [0, 0]]})
    back = Medusa.load(model, tmp_path).heads
    assert back.layers == 3 and len(back.res) == 6
    assert torch.equal(back(h), heads.to(torch.bfloat16).float()(h))  # the file holds bf16


def test_a_head_needs_a_block_and_a_draft_vocabulary_a_shared_head(tmp_path):
    import train  # the script at the repository root
    assert "--head-layers must be at least 1, not 0" in run_cli(train.main, "--method", "medusa", "--out", tmp_path,
                                                                 "--head-layers", "0")
    assert "--draft-vocab narrows the shared lm_head: it needs --shared-head" in run_cli(
        train.main, "--method", "medusa", "--out", tmp_path, "--draft-vocab", "10")


def test_token_heads_read_the_token_each_step_emits_last_and_keep_it_on_disk(tmp_path):
    """--token-input: each head also reads the embedding of the token the model emits after h (its lm_head's
    argmax). Zero maps start as the next-token guess; in decoding, the heads get the embedding of each step's
    last emitted token (the next tree's root); the file says the heads are token heads."""
    model = random_model(TINY)
    save(model, tmp_path)
    heads = Heads(32, 50, 2, model.lm_head, base=model).init_from(model.lm_head)
    h = torch.randn(5, 32)
    assert torch.equal(heads(h), model.lm_head(torch.stack([h, h])))
    with torch.no_grad():
        for m in heads.tok:
            m.weight.normal_(std=0.3)
    nxt = model.lm_head(h).argmax(-1)
    assert torch.equal(heads(h), heads(h, model.embed(nxt)))
    assert not torch.allclose(heads(h), heads(h, model.embed((nxt + 1) % 50)))

    d, seen = Medusa(heads, [(0,), (0, 0)]), []
    propose = d.propose
    d.propose = lambda drafts, *a: seen.append(drafts[:, 1].clone()) or propose(drafts, *a)
    out = generate(model, [1, 2, 3], d, max_new_tokens=12, eos_id=-1)
    ends = torch.tensor(out.step_lengths).cumsum(0) - 1  # each step's last emitted token
    assert len(seen) == out.steps
    assert torch.equal(torch.cat(seen), model.embed(torch.tensor(out.tokens)[ends]))

    save_drafter(tmp_path / "medusa.safetensors", heads, {"base_fingerprint": fingerprint(model), "heads": 2,
                                                          "shared": True, "token": True, "acc": [[0.5], [0.5]],
                                                          "tree": [[0], [0, 0]]})
    back = Medusa.load(model, tmp_path).heads
    assert back.tok is not None and torch.equal(back(h), heads.to(torch.bfloat16).float()(h))  # the file holds bf16


def test_a_draft_vocabulary_drafts_only_its_tokens_and_keeps_its_ids_on_disk(tmp_path):
    """--draft-vocab: shared heads score only the tokens their training targets use most (ties and unseen ones:
    the lowest ids), as the whole lm_head would; no other token is ever a candidate, in decoding or in the
    trainer's accuracies; decoding stays AR's; the file keeps the ids exactly (bf16 holds integers only to 256)."""
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=600, intermediate_size=48)
    model = random_model(args)
    save(model, tmp_path)
    y = torch.tensor([[599, 300], [599, -100], [300, 7], [599, 3]])
    assert draft_vocab(y, 4, 600).tolist() == [3, 7, 300, 599] and draft_vocab(y, 6, 600).tolist()[:2] == [0, 1]
    heads = Heads(32, 600, 2, model.lm_head, draft_vocab=5).init_from(model.lm_head)
    heads.vocab.copy_(draft_vocab(y, 5, 600))
    with torch.no_grad():
        for r in heads.res:
            r.weight.normal_(std=0.3)
    h = torch.randn(6, 32)
    got, full, ids = heads(h, narrow=heads.narrowed()), heads(h), heads.vocab
    assert torch.allclose(got[..., ids], full[..., ids], atol=1e-5)
    out = torch.ones(600, dtype=torch.bool)
    out[ids] = False
    assert bool((got[..., out] == -torch.inf).all())
    assert accuracy(heads, h, torch.full((6, 2), 1), 3) == [[0.0] * 3] * 2  # token 1: never a candidate
    d = Medusa(heads, [(0,), (1,), (0, 0)])
    cands = d.propose(h[:, None]).topk(3, dim=-1).indices
    assert bool(torch.isin(cands, ids).all())
    check_exact(model, [5, 77, 599, 300], d, 16, fast=True)
    save_drafter(tmp_path / "medusa.safetensors", heads, {"base_fingerprint": fingerprint(model), "heads": 2,
                                                          "shared": True, "draft_vocab": 5, "acc": [[0.5], [0.5]],
                                                          "tree": [[0], [0, 0]]})
    back = Medusa.load(model, tmp_path)
    assert back.heads.vocab.dtype == torch.long and back.heads.vocab.tolist() == [0, 3, 7, 300, 599]
    assert torch.equal(back.narrow.weight, model.lm_head.weight[ids])
