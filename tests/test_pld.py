"""Prompt Lookup Decoding's own behaviour: its match is transformers' prompt lookup's, token for token; the other
occurrence and the shortest n-gram; its options on the command line. (Exactness in every mode, batches, a full cache,
graphs, sampling and its acceptance floor: the generic tests, `python -m pytest -k pld`.)"""
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import call, decode_main, reaches_floor, run_cli
from nanospec import NanospecError
from nanospec.methods.pld import PLD

transformers = pytest.importorskip("transformers")


@given(context=st.lists(st.integers(0, 4), min_size=1, max_size=40), num_tokens=st.integers(1, 12),
       max_ngram=st.integers(1, 4))
def test_its_draft_is_transformers_prompt_lookup(context, num_tokens, max_ngram):
    """occurrence=first, min_ngram=1: transformers' PromptLookupCandidateGenerator's candidates, whatever the
    context (few distinct tokens: many matches, overlapping ones, matches running into the context's end)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    theirs = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                            max_length=10**6)
    ids = theirs.get_candidates(torch.tensor([context]))[0][0, len(context):].tolist()
    n, ours = PLD(num_tokens, max_ngram).lookup(context)
    assert ours == ids and (n > 0) == bool(ids)


def test_the_last_occurrence_and_the_shortest_ngram():
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    assert PLD(10, 2).lookup(context) == (2, [3, 1, 2, 4, 1, 2])  # the first "1 2"
    assert PLD(10, 2, occurrence="last").lookup(context) == (2, [4, 1, 2])  # the most recent
    assert PLD(2, 3, occurrence="last").lookup(context) == (2, [4, 1])  # no earlier "4 1 2": the 2-gram, 2 tokens
    assert PLD(10, 2).lookup([5, 1, 6, 1]) == (1, [6, 1])  # only the 1-gram "1" occurred before
    assert PLD(10, 2, min_ngram=2).lookup([5, 1, 6, 1]) == (0, [])  # ... which min_ngram=2 refuses
    assert PLD(10, 2).lookup([7]) == (0, [])


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
    assert "pld occurrence 'middle'" in run_cli(decode_main, "--weights", weights, "--method", "pld:occurrence=middle")
    assert "pld has no option 'n'" in run_cli(decode_main, "--weights", weights, "--method", "pld:n=3")
    for bad in (dict(min_ngram=3), dict(min_ngram=0), dict(num_tokens=0)):
        with pytest.raises(NanospecError, match="num_tokens >= 1 and 1 <= min_ngram <= max_ngram"):
            PLD(**bad)
