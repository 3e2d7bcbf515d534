"""Exact mode's kernel count: the non-view aten ops of one step's program (tuning.counts.step_ops), counted from
the CPU stand-in's trace as a GPU runs it (RESULTS.md, "Kernels per step"). An op added to every layer moves
AR's pinned count and fails here; each method's layers cost at most a few ops more than AR's, its own head's
ops (which do not grow with the layers) apart."""
from dataclasses import replace

import pytest
import torch

from helpers import ARGS, DRAFTING, METHODS, AlignedProducts, drafter, family_args, full_logits, random_model
from nanospec import devices, engine, forward
from nanospec.engine import Decoding
from nanospec.model import ModelArgs
from nanospec.sizes import shapes
from nanospec.tree import Tree
from nanospec.tuning.counts import host_work, step_mb, step_ops

AR_PER_LAYER = {torch.float32: 32, torch.bfloat16: 36}  # bf16: RMSNorm's casts
EXTRA = 8  # a method may add a few ops a layer (SDSAT's update of every product on its adaptive rows: two each)
# every family's switches at once (helpers.family_args "all"), per layer beside Llama's: Qwen2's biases ride in the
# products' kernel and Mistral's window in the step's visibility (no layer's); Qwen3's q/k norm is one RMSNorm over
# both, its weights joined (a cat)
FAMILIES_EXTRA = 7


def per_layer(name, dtype=torch.float32, family="llama") -> float:
    """A step's ops per layer: how its count grows from 3 to 6 layers (a head's ops do not grow)."""
    counts = []
    for n in (3, 6):
        model = random_model(replace(family_args(ARGS, family), n_layers=n), seed=0, dtype=dtype)
        counts.append(step_ops(model, drafter(name, model)))
    return (counts[1] - counts[0]) / 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ar_ops_per_layer_are_pinned(dtype):
    assert per_layer("ar", dtype) == AR_PER_LAYER[dtype]


def test_an_op_added_to_every_layer_is_counted(monkeypatch):
    layer = forward.exact_layer
    monkeypatch.setattr(forward, "exact_layer", lambda lay, x, *a: layer(lay, x * 1.0, *a))  # a planted op
    assert per_layer("ar") == AR_PER_LAYER[torch.float32] + 1


def test_the_families_ops_per_layer_are_pinned():
    assert per_layer("ar", family="all") == AR_PER_LAYER[torch.float32] + FAMILIES_EXTRA


@pytest.mark.parametrize("name", DRAFTING)
def test_a_methods_layers_cost_at_most_a_few_ops_more_than_ars(name):
    assert per_layer(name) <= AR_PER_LAYER[torch.float32] + EXTRA


def test_counting_leaves_exact_mode_as_it_found_it():
    """step_ops counts a step as a GPU runs it, without the CPU's exact layout; afterwards exact mode runs as
    before: the same programs, keys padded as before, the same bits under a BLAS whose bits follow a row's
    alignment (AlignedProducts: without aligned rows they move)."""
    model = random_model(replace(ARGS, n_layers=1), seed=0)

    def exact_mode():
        with AlignedProducts():
            logits = full_logits(model, [3, 9, 4, 1, 7, 12, 5, 8], True)
        keys = forward.context(model, Tree.chain(3).block(0), 40, True).canonical.tail_slots.shape
        return dict(devices.DEVICES), keys, logits
    programs, keys, logits = exact_mode()
    step_ops(model)
    after = exact_mode()
    assert after[:2] == (programs, keys) and torch.equal(after[2], logits)


# --- what a step writes, and what it launches outside its program ------------------------------------------------

MB_ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, vocab_size=64, intermediate_size=64)


def written_per_row_and_slot(name) -> float:
    """The bytes a step's program writes per cache slot and row of its block, as a multiple of the cache's own
    bytes per slot: how its MB grow from a cache of 64 slots to 128 (the weights' and the rows' activations do
    not grow), over its block's rows. A copy of the cache for each row is 1 or more."""
    model = random_model(MB_ARGS, seed=0)
    d = drafter(name, model)
    mb = [step_mb(model, d, S) for S in (64, 128)]
    a, Q = model.args, shapes([d or engine.AR], 32, 3)[0]
    cache = 2 * a.n_layers * a.kv_heads * a.hd * 4 / 1e6  # MB per slot: keys and values, every layer
    return (mb[1] - mb[0]) / 64 / cache / Q


@pytest.mark.parametrize("name", METHODS)
def test_a_step_writes_no_copy_of_the_cache_per_row(name):
    """Exact attention reads the cache in place: what a step writes per slot is its scores and masks (a few
    numbers per row of the block), far below a copy of the cache for each of its rows."""
    assert written_per_row_and_slot(name) < 0.5


def test_a_copy_of_the_cache_per_row_is_counted(monkeypatch):
    attend = forward.attend_exact

    def copying(q, kv, ctx):  # planted: every row's own copy of its sequence's keys and values
        kv.unsqueeze(2).expand(-1, -1, q.shape[1], -1, -1, -1).contiguous()
        return attend(q, kv, ctx)
    monkeypatch.setattr(forward, "attend_exact", copying)
    assert written_per_row_and_slot("ar") > 1


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", METHODS)
def test_a_step_launches_little_outside_its_program(name, batch):
    """At the CUDA defaults, on the second-device stand-in: a step's inputs go to the device as one copy, its
    program is one launch, its results come back in one read-back, the step's one sync."""
    model = random_model(ARGS, seed=0)
    launches, syncs = host_work(model, lambda m: drafter(name, m), batch, steps=(3, 6))
    assert launches <= 8 and syncs == 1


def test_an_eager_op_in_the_advance_is_counted(monkeypatch):
    advance = Decoding.advance

    def eager(self, *a, **k):  # planted: a device op per sequence and step outside the program
        self.cache.kv[0, 0, self.cache_row, 0, 0].add_(0)
        return advance(self, *a, **k)
    model = random_model(ARGS, seed=0)
    before = host_work(model, lambda m: drafter("medusa", m), 1, steps=(3, 6))
    monkeypatch.setattr(Decoding, "advance", eager)
    assert host_work(model, lambda m: drafter("medusa", m), 1, steps=(3, 6)) == (before[0] + 1, before[1])
