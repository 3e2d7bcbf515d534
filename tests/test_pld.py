"""Prompt Lookup Decoding's own behaviour: its match is transformers' prompt lookup's, token for token, and a brute
force's with every option; its drafts as trees; no match, stale text, the cache's end and a batch in the engine; its
options on the command line. (Exactness in every mode, batches, a full cache, graphs, sampling and its acceptance
floor with its defaults: the generic tests, `python -m pytest -k pld`.)"""
import json
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import ARGS, call, check_exact, decode_main, each_dtype, model_args, random_model, reaches_floor, run_cli
from nanospec.engine import generate
from nanospec.methods.pld import OCCURRENCES, PLD

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def brute_force(context, num_tokens, max_ngram, min_ngram, occurrence):
    """The algorithm as its description reads, by enumeration: every earlier occurrence (not the suffix itself) of
    every suffix length from min_ngram to max_ngram; the longest length that has one, its first or last
    occurrence; the num_tokens tokens after it."""
    L = len(context)
    found = {n: [i for i in range(L) if i + n < L and context[i:i + n] == context[L - n:]]
             for n in range(min_ngram, max_ngram + 1) if n < L}
    n = max((n for n, at in found.items() if at), default=0)
    if not n:
        return 0, []
    i = min(found[n]) if occurrence == "first" else max(found[n])
    return n, context[i + n:i + n + num_tokens]


@given(context=st.lists(st.integers(0, 4), min_size=1, max_size=40), num_tokens=st.integers(1, 12),
       max_ngram=st.integers(1, 4))
def test_its_draft_is_transformers_prompt_lookup(context, num_tokens, max_ngram):
    """occurrence=first, min_ngram=1: transformers' PromptLookupCandidateGenerator's candidates, whatever the
    context (few distinct tokens: many matches, overlapping ones, matches running into the context's end)."""
    pytest.importorskip("transformers")
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    theirs = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                            max_length=10**6)
    ids = theirs.get_candidates(torch.tensor([context]))[0][0, len(context):].tolist()
    n, ours = PLD(num_tokens, max_ngram).lookup(context)
    assert ours == ids and (n > 0) == bool(ids)


@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), num_tokens=st.integers(1, 12),
       ngrams=st.tuples(st.integers(1, 6), st.integers(1, 6)).map(sorted), occurrence=st.sampled_from(OCCURRENCES))
def test_its_lookup_is_the_brute_force_of_its_description(context, num_tokens, ngrams, occurrence):
    """Every option (the last occurrence and a min_ngram over 1 included, which transformers has not), over
    contexts shorter and longer than the n-grams: the longest suffix that occurred before, the occurrence the option
    names, at most num_tokens after it, never an empty draft for a match."""
    min_ngram, max_ngram = ngrams
    n, drafts = PLD(num_tokens, max_ngram, min_ngram, occurrence).lookup(context)
    assert (n, drafts) == brute_force(context, num_tokens, max_ngram, min_ngram, occurrence)
    assert (n == 0 or min_ngram <= n <= max_ngram) and (n > 0) == (0 < len(drafts) <= num_tokens)


def test_the_last_occurrence_and_each_options_edge():
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    assert PLD(10, 2).lookup(context) == (2, [3, 1, 2, 4, 1, 2])  # the first "1 2"
    assert PLD(10, 2, occurrence="last").lookup(context) == (2, [4, 1, 2])  # the most recent
    assert PLD(2, 3, occurrence="last").lookup(context) == (2, [4, 1])  # no earlier "4 1 2": the 2-gram, 2 tokens
    assert PLD(1, 2).lookup(context) == (2, [3])  # num_tokens 1: one token
    assert PLD(10, 2).lookup([5, 1, 6, 1]) == (1, [6, 1])  # only the 1-gram "1" occurred before
    assert PLD(10, 2, min_ngram=2).lookup([5, 1, 6, 1]) == (0, [])  # ... which min_ngram=2 refuses
    assert PLD(10, 4, min_ngram=4).lookup([1, 1, 1]) == (0, [])  # min_ngram over the context's length
    assert PLD(10, 4).lookup([1, 1, 1]) == (2, [1])  # ... where a shorter one matches
    assert PLD(10, 2).lookup([7]) == (0, [])


@given(texts=st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=3),
       prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12), out=st.lists(st.integers(0, 3), max_size=12),
       num_tokens=st.integers(1, 8), max_ngram=st.integers(1, 3), occurrence=st.sampled_from(OCCURRENCES),
       budget=st.none() | st.integers(0, 10))
def test_its_draft_is_one_chain_from_warm_up_prompt_and_output(texts, prompt, out, num_tokens, max_ngram,
                                                               occurrence, budget):
    """The tree it drafts is a chain at the last emitted token of the lookup's drafts over warm_up's texts, then the
    prompt, then the output; a budget keeps its first nodes (nested: a budget-s draft is the whole's first s + 1
    nodes); never more than max_draft drafts; matched and its match_length are the n-gram's length."""
    d = PLD(num_tokens, max_ngram, occurrence=occurrence)
    d.warm_up(texts)
    dec = SimpleNamespace(prompt=prompt, out=out, root=(prompt + out)[-1])
    n, drafts = PLD(num_tokens, max_ngram, occurrence=occurrence).lookup([t for x in texts for t in x] + prompt + out)
    tree, whole = d.draft(dec, None, None, budget), d.draft(dec, None, None, None)
    assert tree.token_list() == [dec.root, *drafts[:budget]] and list(tree.parents) == list(range(-1, len(tree) - 1))
    assert tree.token_list() == whole.token_list()[:len(tree)] and len(whole) - 1 <= d.max_draft
    assert tree.matched == d.match_length(dec) == n


def test_no_match_is_an_ar_step(device):
    """A context with no earlier occurrence of its last min_ngram tokens drafts the root alone: that step is AR's,
    one token. Here the prompt's tokens are distinct and only AR's output from its 17th token on is fed: the early
    steps mostly find no match, the later ones draft and are accepted, and the whole output is AR's, bitwise."""
    model, prompt, steps = random_model(ARGS, 2, device=device), list(range(10, 22)), []
    d = PLD(8, 3, min_ngram=2)
    d.warm_up([generate(model, prompt, max_new_tokens=40, eos_id=-1).tokens[16:]])
    out = check_exact(model, prompt, d, 40,
                      on_step=lambda dec, step: steps.append((step.tree.matched, len(step.tree), len(step.tokens))))
    assert all((m == 0) == (size == 1) for m, size, _ in steps) and all(k == 1 for m, _, k in steps if not m)
    assert steps[0][:2] == (0, 1) and sum(m == 0 for m, _, _ in steps) >= 10
    assert any(k > 1 for m, _, k in steps if m) and out.tokens_per_step > 1.5


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 40), num_tokens=st.integers(1, 12),
       ngrams=st.tuples(st.integers(1, 4), st.integers(1, 4)).map(sorted), occurrence=st.sampled_from(OCCURRENCES),
       sampled=st.booleans(), tight=st.booleans())
def test_exact_mode_logits_bitwise_equal_ar(device, dtype, args, seed, plen, num_tokens, ngrams, occurrence,
                                           sampled, tight):
    """With every option setting, AR's output and, in exact mode, its logits bitwise (fast mode: its tokens, in fp32),
    fed AR's continuation beside junk text (so drafts are accepted and rejected), sampled or greedy, in a cache with
    room for the output or just enough for it."""
    model = random_model(args, seed, DTYPES[dtype], device)
    rng = random.Random(seed)
    motif = [rng.randrange(args.vocab_size) for _ in range(rng.randint(2, 6))]
    prompt = [rng.choice(motif) if rng.random() < 0.8 else rng.randrange(args.vocab_size) for _ in range(plen)]
    d = PLD(num_tokens, ngrams[1], ngrams[0], occurrence)
    d.warm_up([[rng.randrange(args.vocab_size) for _ in range(10)] for _ in range(3)])
    sampling = dict(temperature=1.0, top_k=0, top_p=0.9, seed=seed) if sampled else None
    check_exact(model, prompt, d, 24, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed, tight=tight)


def test_the_last_occurrence_drafts_from_the_most_recent_text():
    """Two earlier texts hold the output: a stale one, every fourth token wrong, then the right one. The first
    occurrence drafts from the stale text and loses its drafts at the next wrong token; the last drafts from the
    right one. Both are AR's bitwise; the last accepts more per step."""
    model, prompt = random_model(ARGS, 7), [3, 9, 4, 1, 7, 12, 5]
    ar = generate(model, prompt, max_new_tokens=48, eos_id=-1).tokens
    stale = [t if i % 4 else (t + 1) % ARGS.vocab_size for i, t in enumerate(ar)]
    accepted = {}
    for occurrence in OCCURRENCES:
        d = PLD(10, 2, occurrence=occurrence)
        d.warm_up([prompt[-1:] + stale, prompt[-1:] + ar])
        accepted[occurrence] = check_exact(model, prompt, d, 40).tokens_per_step
    assert accepted["last"] > 4 and accepted["last"] > accepted["first"] + 1, accepted


def test_its_drafts_are_cut_at_the_caches_end(device):
    """Fed AR's continuation, its ten-token drafts run past a cache with room for the output alone: the engine
    verifies only the drafts that fit (a step's tree shorter than its whole draft), and the output is AR's, bitwise,
    to its last token."""
    model, steps = random_model(ARGS, 2, device=device), []
    out = check_exact(model, [3, 9, 4, 1, 7, 12, 5], PLD(10, 2), 40, peeking=1.0, tight=True,
                      on_step=lambda dec, step: steps.append((len(step.tree), len(step.whole), dec.room)))
    assert out.stop == "max_new_tokens" and out.tokens_per_step > 4
    assert any(size < whole for size, whole, _ in steps)


def test_in_a_batch_each_sequence_drafts_from_its_own_context():
    """One PLD decodes three prompts of disjoint tokens at once: every step's draft follows an earlier occurrence of
    the matched n-gram in that sequence's own prompt and output, each sequence drafts, and each emits what it
    emits alone."""
    model = random_model(ARGS, 5)
    prompts = [[10, 11, 12, 13] * 3, [20, 21, 22] * 4, [30, 31, 32, 33, 34] * 2]
    d, drafted = PLD(6, 3), set()

    def check(dec, step):
        context = dec.prompt + dec.out[:len(dec.out) - len(step.tokens)]
        n, drafts, L = step.tree.matched, step.tree.token_list()[1:], len(context)
        if drafts:
            drafted.add(tuple(dec.prompt))
            assert any(context[i:i + n] == context[L - n:] and context[i + n:i + n + len(drafts)] == drafts
                       for i in range(L - n)), (dec.prompt, drafts)
    batch = generate(model, prompts, d, max_new_tokens=24, eos_id=-1, on_step=check)
    assert drafted == set(map(tuple, prompts))
    assert [b.tokens for b in batch] == [generate(model, p, max_new_tokens=24, eos_id=-1).tokens for p in prompts]


def test_an_off_by_one_in_its_proposal_falls_under_its_floor(monkeypatch):
    """Drafts one token late (the tokens after the one that followed the match): still exact, so only the floor
    (helpers.reaches_floor, the generic test's check) sees it."""
    reaches_floor("pld", checked=False)
    lookup = PLD.lookup
    monkeypatch.setattr(PLD, "lookup", lambda self, context: (lambda n, d: (n, d[1:]))(*lookup(self, context)))
    with pytest.raises(AssertionError, match="under its floor"):
        reaches_floor("pld", checked=False)


def test_its_options_on_the_command_line(weights):
    code, out, err = call(decode_main, "--weights", weights, "--method", "pld:num_tokens=4,max_ngram=3,occurrence=last",
                          "--prompt", "def f(x):\n    return f(x)\ndef f(x):", "--max-new-tokens", 16, "--mode",
                          "exact", "--check", "--json")
    assert code == 0 and json.loads(out.splitlines()[-1])["identical_to_ar"] is True, err
    assert "pld has no option 'n'" in run_cli(decode_main, "--weights", weights, "--method", "pld:n=3")


NEEDS = "pld needs whole numbers num_tokens >= 1 and 1 <= min_ngram <= max_ngram, not"


BAD = [  # an option the command line can give, and its error
    ("occurrence=middle", "pld occurrence 'middle': choose from first, last"),
    ("occurrence=2", "pld occurrence 2: choose from first, last"),
    ("num_tokens=0", f"{NEEDS} 0, 1, 2"),
    ("min_ngram=0", f"{NEEDS} 10, 0, 2"),
    ("min_ngram=3", f"{NEEDS} 10, 3, 2"),  # over max_ngram
    ("num_tokens=2.5", f"{NEEDS} 2.5, 1, 2"),
    ("max_ngram=two", f"{NEEDS} 10, 1, 'two'"),
    ("min_ngram=true", f"{NEEDS} 10, True, 2"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[options for options, _ in BAD])
def test_a_bad_option_value_is_one_clear_error(weights, options, message):
    """Each value the command line can give that PLD cannot run with (out of range, not a whole number, not an
    occurrence) stops it with one error line naming the values (a NanospecError), not a traceback from the lookup."""
    assert run_cli(decode_main, "--weights", weights, "--method", f"pld:{options}") == f"error: {message}"
