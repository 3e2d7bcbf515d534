"""Teacher-forced self-distillation (training/forced.py): a target is the model's own token k ahead exactly where
the text went on as the model would; on distilled pairs the targets are the continuation's tokens, as before."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ARGS, random_model
from nanospec.engine import generate
from nanospec.training.forced import label, labelled, pieces, start, targets


def test_targets_stop_where_the_text_leaves_the_models_path():
    tokens, labels = [5, 6, 7, 8, 9], [6, 7, 1, 9, 2]  # the text agrees after 0, 1 and 3, not after 2
    assert targets(tokens, labels, 2).tolist() == [[7, 1], [1, -100], [-100, -100], [2, -100], [-100, -100]]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.lists(st.integers(0, 50), min_size=1, max_size=12),
       st.integers(1, 4))
def test_a_distilled_pair_gives_its_continuation_k_ahead(p, c, K):
    seq = p + c
    y = targets(*labelled((p, c)), K)
    for t in range(len(seq)):
        for k in range(1, K + 1):
            want = seq[t + 1 + k] if len(p) - 1 <= t and t + 1 + k < len(seq) else -100
            assert y[t, k - 1] == want


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3))
def test_a_forced_target_is_what_greedy_decoding_emits(seed, K):
    """On a random model, text made of its own greedy tokens with a few changed: every known target is the token
    greedy decoding emits k + 1 after that prefix."""
    model = random_model(ARGS, seed=seed % 7)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, ARGS.vocab_size, (4,), generator=g).tolist()
    text = prompt + generate(model, prompt, max_new_tokens=20, eos_id=-1).tokens
    for i in torch.randint(4, len(text), (3,), generator=g).tolist():  # the text leaves the model's path there
        text[i] = (text[i] + 1) % ARGS.vocab_size
    (tokens, labels), = label(model, [text])
    y, checked = targets(tokens, labels, K), 0
    for t in range(len(text)):
        if (y[t] >= 0).any():
            out = generate(model, text[:t + 1], max_new_tokens=K + 1, eos_id=-1).tokens
            for k in range(1, K + 1):
                assert y[t, k - 1] < 0 or y[t, k - 1] == out[k]
                checked += int(y[t, k - 1] >= 0)
    assert checked > 0


def test_pieces_keep_every_label_and_start_where_drafting_does():
    items = [labelled(([1, 2, 3], [4, 5, 6, 7])), ([8, 9, 10, 11, 12], [9, 10, 0, 12, 13])]
    assert [start(lab) for _, lab in items] == [3, 1]  # a pair's prompt length; a forced window's first token
    cut = pieces(items, 3)
    assert cut == [([4, 5, 6], [5, 6, 7]), ([8, 9, 10], [9, 10, 0]), ([11, 12], [12, 13])]  # ([1, 2, 3], ...) has 1
    assert pieces(items, 100) == items
