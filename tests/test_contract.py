"""The generic tests see a method that breaks the Drafter contract (drafter.py) or drafts worse than it declares,
without naming it: each fault planted into every registered method (its drafter's hooks monkeypatched), and caught.

- It drafts one position late (an off-by-one in its proposal): still exact, but under its floor.
- A drafting hook changes the decoding state (its drafts added to the context it reads): the guard around the
  hooks (helpers.guarded) names the hook.
- A drafting hook writes into the cache outside its reserved slots (a key of the prompt): AR's bits are not kept."""
import pytest

from helpers import ARGS, DRAFTING, METHODS, check_exact, drafter, random_model, reaches_floor
from nanospec.methods import METHODS as REGISTRY
from nanospec.tree import Tree

PROMPT = [3, 9, 4, 1, 7, 12, 5]


def planted(monkeypatch, name, fault):
    """Every drafter of the method drafts through fault(dec, tree), which may change the tree it returns."""
    cls, make = REGISTRY[name], REGISTRY[name].random.__func__

    def random(cls, model, seed=0):
        d = make(cls, model, seed)
        draft = d.draft
        d.draft = lambda dec, *a: fault(dec, draft(dec, *a))
        return d
    monkeypatch.setattr(cls, "random", classmethod(random))


def late(dec, tree: Tree) -> Tree:
    """Each drafted node's token is its parent's: what the method drafted for a position, one position late."""
    tokens = tree.token_list()
    return Tree([tokens[0]] + [tokens[p] for p in tree.parents[1:]], tree.parents, tree.matched)


@pytest.mark.parametrize("name", DRAFTING)
def test_a_method_drafting_one_position_late_falls_under_its_floor(name, monkeypatch):
    """Planted, the decoding whose figure passes (test_edges.py) falls under the method's floor."""
    planted(monkeypatch, name, late)
    with pytest.raises(AssertionError, match="under its floor"):
        reaches_floor(name, checked=False)


@pytest.mark.parametrize("name", DRAFTING)
def test_a_drafting_hook_changing_the_decoding_state_is_caught(name, monkeypatch):
    def into_context(dec, tree):
        dec.prompt = dec.prompt + tree.token_list()[1:]  # its drafts, unverified, in the context it reads
        return tree
    model = random_model(ARGS, seed=2)  # unplanted, the same check passes: test_edges.py, test_batch.py
    planted(monkeypatch, name, into_context)
    with pytest.raises(AssertionError, match="draft hook changed the decoding state"):
        check_exact(model, PROMPT, drafter(name, model), 12, peeking=0.9)


@pytest.mark.parametrize("name", METHODS)
def test_a_drafting_hook_writing_the_cache_outside_its_slots_is_caught(name, monkeypatch):
    def writes(dec, tree):
        dec.cache.kv[:, :, dec.cache_row, :, 0] += 1.0  # slot 0: the prompt's first key, which every later row reads
        return tree
    model = random_model(ARGS, seed=2)  # unplanted, the same check passes: test_edges.py, test_batch.py
    planted(monkeypatch, name, writes)
    with pytest.raises(AssertionError, match="not AR's tokens and bits"):
        check_exact(model, PROMPT, drafter(name, model), 12, fast=False, peeking=0.9)
