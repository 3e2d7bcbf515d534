"""Exact mode's kernel count: the non-view aten ops of one step's program (tuning.cuda.step_ops), counted from
the CPU stand-in's trace as a GPU runs it (RESULTS.md, "Kernels per step"). An op added to every layer moves
AR's pinned count and fails here; each method's layers cost at most a few ops more than AR's, its own head's
ops (which do not grow with the layers) apart."""
from dataclasses import replace

import pytest
import torch

from helpers import family_args, random_model
from nanospec import model as llama
from nanospec.tuning.cuda import step_ops
from test_batch import batch_drafter
from test_edges import ARGS, METHODS

AR_PER_LAYER = {torch.float32: 29, torch.bfloat16: 33}  # bf16: RMSNorm's and softmax's casts
EXTRA = {"sdsat": 16}  # SDSAT updates every product of its adaptive rows; the others may add 6
# every family's switches at once (helpers.family_args "all"), per layer beside Llama's: Qwen2's biases ride in the
# products' kernel and Mistral's window in the step's visibility (no layer's); Qwen3's q/k norm is one RMSNorm over
# both, its weights joined (a cat)
FAMILIES_EXTRA = 7


def per_layer(name, dtype=torch.float32, family="llama") -> float:
    """A step's ops per layer: how its count grows from 3 to 6 layers (a head's ops do not grow)."""
    counts = []
    for n in (3, 6):
        model = random_model(replace(family_args(ARGS, family), n_layers=n), seed=0, dtype=dtype)
        counts.append(step_ops(model, batch_drafter(name, model)))
    return (counts[1] - counts[0]) / 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ar_ops_per_layer_are_pinned(dtype):
    assert per_layer("ar", dtype) == AR_PER_LAYER[dtype]


def test_an_op_added_to_every_layer_is_counted(monkeypatch):
    forward = llama.Layer.forward
    monkeypatch.setattr(llama.Layer, "forward", lambda self, x, *a: forward(self, x * 1.0, *a))  # a planted op
    assert per_layer("ar") == AR_PER_LAYER[torch.float32] + 1


def test_the_families_ops_per_layer_are_pinned():
    assert per_layer("ar", family="all") == AR_PER_LAYER[torch.float32] + FAMILIES_EXTRA


@pytest.mark.parametrize("name", METHODS)
def test_a_methods_layers_cost_at_most_a_few_ops_more_than_ars(name):
    assert per_layer(name) <= AR_PER_LAYER[torch.float32] + EXTRA.get(name, 6)
