"""Sliding windows as real checkpoints have them: longer than exact mode's tail. A Mistral's window (4,096 keys) is far
longer than the W keys each exact row gathers in canonical order, so its rows read most in-window keys in place, and
the window's edge falls among them; only a window shorter than the tail puts the edge inside the tail.

Against transformers' own Mistral checkpoints with windows shorter than the tail, equal to it, one key longer and
several times longer, on prompts that outrun the window: logits at every position (the prefill's chunks and each
decoded token) and greedy ids, in exact and fast mode; every method's tree steps past the window bitwise AR's in
exact mode (fp32 and bf16). Each planted off-by-one, at the edge of the keys read in place and at the tail's, is
caught: the plant moves `exact.left_window`'s comparison by one, for the keys read in place or for the tail alone."""
from unittest import mock

import pytest
import torch

from helpers import METHODS, drafter, feed, hf_family
from nanospec import devices, exact, forward
from nanospec.drafter import AR
from nanospec.engine import Decoding, generate, shapes
from nanospec.io.checkpoint import load

transformers = pytest.importorskip("transformers")
TAIL = shapes([AR], 1, 1)[2] - shapes([AR], 1, 1)[2] % -devices.of("cpu").grain(torch.float32)[0]  # AR's W here
WINDOWS = {"shorter": 8, "tail": TAIL, "tail+1": TAIL + 1, "3tail+5": 3 * TAIL + 5}
PROMPT = torch.randint(3, 400, (110,), generator=torch.Generator().manual_seed(2)).tolist()  # past every window
NEW = 24


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """window -> (transformers' Mistral with that window, its directory), written once."""
    out = {}
    for window in WINDOWS.values():
        path = tmp_path_factory.mktemp(f"mistral{window}")
        out[window] = hf_family(path, "mistral", sliding_window=window), path
    return out


def planted(monkeypatch, where: str) -> list:
    """exact.left_window one key late (`<` for `<=`: a row keeps the key that just left its window) where `where`
    says: "in place", the slots read in place (canonical asks of them as one row, (S + 1,)), or "tail", the gathered
    keys (B, T, W)."""
    left, calls = exact.left_window, []

    def late(pos, gone):
        calls.append(pos.dim())
        return (pos < gone) if (pos.dim() == 1) == (where == "in place") else left(pos, gone)
    monkeypatch.setattr(exact, "left_window", late)
    return calls


def our_logits(model, exact: bool) -> tuple[torch.Tensor, list[int]]:
    """(logits at every position of PROMPT and its greedy continuation, as decoding computes them: the prefill's
    chunks, each reading the keys committed before it, then each step's; the continuation's ids)."""
    chunks, run = [], Decoding.run
    with mock.patch.object(Decoding, "run", lambda d, block: chunks.append(run(d, block)) or chunks[-1]):
        out = generate(model, PROMPT, max_new_tokens=NEW, exact=exact, eos_id=-1, record_logits=True)
    return torch.cat(chunks + [out.logits]).float(), out.tokens


def agrees(hf, model, exact: bool) -> bool:
    """Our logits within 1e-5 of transformers' at every position, and our greedy ids its generate's."""
    logits, ids = our_logits(model, exact)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + ids[:-1]])).logits[0].float()
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    return ids == theirs and (logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", WINDOWS)
def test_logits_and_ids_are_transformers(mistral, name):
    hf, path = mistral[WINDOWS[name]]
    model = load(path)
    assert model.args.sliding_window == WINDOWS[name] and len(PROMPT) > WINDOWS[name]
    assert agrees(hf, model, exact=True) and agrees(hf, model, exact=False)


def test_the_windows_are_measured_against_the_tail_in_use(mistral, monkeypatch):
    """TAIL is the tail the steps above and below gather (a device's grain may round it up)."""
    seen, canonical = set(), exact.canonical

    def spy(*args, **kwargs):
        order = canonical(*args, **kwargs)
        seen.add(order.tail_slots.shape[-1])
        return order
    monkeypatch.setattr(forward, "canonical", spy)
    model = load(mistral[TAIL][1])
    for d in [None, *(drafter(n, model) for n in METHODS)]:
        generate(model, PROMPT[:20], d, max_new_tokens=4, exact=True, eos_id=-1)
    assert seen == {TAIL}


@pytest.mark.parametrize("window, dtype", [(TAIL, torch.float32), (TAIL + 1, torch.float32), (TAIL + 1, torch.bfloat16),
                                           (3 * TAIL + 5, torch.float32)])
@pytest.mark.parametrize("method", METHODS)
def test_tree_steps_past_the_window_are_ar_bitwise(mistral, method, window, dtype):
    """Every step sits past the window (its rows read in-window keys in place and see some leave); drafts carry
    AR's tokens (helpers.feed), so tree rows get accepted and checked."""
    model = load(mistral[window][1], dtype)
    d = drafter(method, model)
    Q, S, W = shapes([d], len(PROMPT), NEW)
    kw = dict(max_new_tokens=NEW, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True)
    ar = generate(model, PROMPT, **kw)
    out = generate(model, PROMPT, feed(d, [PROMPT], [ar]), **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits)
    assert d.max_rows == 1 or out.steps < NEW * 2 / 3, "too few drafts accepted to test tree rows"


@pytest.mark.parametrize("name", ["tail", "tail+1", "3tail+5"])
def test_a_key_kept_at_the_edge_read_in_place_is_caught(mistral, name, monkeypatch):
    """A row reads in place one key that left its window."""
    hf, path = mistral[WINDOWS[name]]
    calls = planted(monkeypatch, "in place")
    assert not agrees(hf, load(path), exact=True) and 1 in calls


def test_a_key_kept_at_the_edge_of_the_tail_is_caught(mistral, monkeypatch):
    """A row gathers into its tail one key that left its window (a window shorter than the tail, where the edge falls
    in the tail)."""
    hf, path = mistral[WINDOWS["shorter"]]
    calls = planted(monkeypatch, "tail")
    assert not agrees(hf, load(path), exact=True) and 3 in calls
