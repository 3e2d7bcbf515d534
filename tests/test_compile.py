"""compile=True: exact mode's layer as one compiled callable (compiled.py), which AR's programs and every
method's call alike. Every method's accepted logits are then bitwise AR's, AR compiled too, in fp32 and bf16, for
each prompt alone and in a batch. Inductor's C++ backend runs it on a CPU; the runs share one Q and S, so each
dtype compiles a handful of shapes."""
from dataclasses import replace

import pytest
import torch

from helpers import ARGS, METHODS, drafter, family_args, feed, random_model
from nanospec import NanospecError, compiled
from nanospec.engine import AR, generate, shapes

PROMPTS = [[3, 9, 4, 1, 7, 12, 5], [5, 2, 8, 8, 1, 12, 30, 4, 11, 2]]
N = 20


MODELS = {}  # per dtype and device: one model, and AR's compiled outputs at the shapes every method shares


def compiled_ar(dtype, device):
    """The model, exact mode's shapes every method fits (so each dtype compiles a handful of shapes, whichever
    methods run) and AR's compiled outputs; made once per dtype and device, and checked to have compiled."""
    if (dtype, device) not in MODELS:
        model = random_model(ARGS, seed=4, dtype=dtype, device=device)
        Q, S, W = shapes([AR] + [drafter(n, model) for n in METHODS], max(map(len, PROMPTS)), N)
        kw = dict(max_new_tokens=N, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True, compile=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        alone = [generate(model, p, **kw) for p in PROMPTS]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, "AR ran no compiled layer"
        MODELS[dtype, device] = model, kw, alone
    return MODELS[dtype, device]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_compiled_is_bitwise_ar_compiled(name, dtype, device):
    """On CUDA (`pytest --device cuda`) the compiled layer runs inside the step programs' CUDA graphs."""
    model, kw, alone = compiled_ar(dtype, device)
    d = feed(drafter(name, model), PROMPTS, alone, seed=1)
    outs = generate(model, PROMPTS, d, **kw)
    for a, b in zip(alone, outs):
        assert b.tokens == a.tokens and torch.equal(b.logits, a.logits)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    generate(model, PROMPTS, d, **kw)  # shapes seen: nothing compiles again (no graph per step or layer)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert d.max_rows == 1 or sum(len(b.tokens) - b.steps for b in outs) > 0  # drafts were accepted: own rows ran


def test_every_familys_switches_compile_bitwise():
    """q/k/v biases, q/k norms and a window shorter than the prompt (every family's switches at once), compiled:
    Medusa's logits bitwise AR's."""
    model = random_model(family_args(ARGS, "all"), seed=4)
    d, prompt = drafter("medusa", model), PROMPTS[1]
    Q, S, W = shapes([AR, d], len(prompt), N)
    kw = dict(max_new_tokens=N, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True, compile=True)
    ar = generate(model, prompt, **kw)
    feed(d, [prompt], [ar], seed=1)
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits) and out.steps < len(out.tokens)


def test_compile_is_exact_modes():
    model = random_model(ARGS, seed=4)
    with pytest.raises(NanospecError, match="exact=True"):
        generate(model, PROMPTS[0], max_new_tokens=2, compile=True)


def test_more_layers_and_other_weights_compile_nothing_new():
    """The compiled layer takes every layer's weights (and SDSAT's per-layer update) as inputs: a model with other
    weights and more layers of the same shapes runs on the graphs already compiled."""
    kw = dict(max_new_tokens=N, exact=True, eos_id=-1, compile=True)
    for n_layers in (3, 5):
        model = random_model(replace(ARGS, n_layers=n_layers), seed=n_layers)
        d = drafter("sdsat", model)
        Q, S, W = shapes([AR, d], max(map(len, PROMPTS)), N)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        generate(model, PROMPTS[0], d, Q=Q, n_slots=S, tail=W, **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_inductor_picks_kernels_by_rule():
    """Two compiled graphs of the same ops (AR's, and SDSAT's with its product delta) must sum in the same order: on
    CUDA inductor would otherwise time a reduction's configs and keep the fastest (compiled.py)."""
    import torch._inductor
    assert compiled.options() == ({"deterministic": True} if hasattr(torch._inductor.config, "deterministic") else {})


def test_the_compiled_layer_is_counted_in_fewer_kernels_than_its_eager_ops():
    """The bench's compiled_kernels_per_layer (read off inductor's code): inductor fuses the plain layer's elementwise
    ops, so a compiled layer launches fewer kernels than its eager ops, and at least its products."""
    from nanospec.tuning.counts import compiled_per_layer, ops_per_layer
    model = random_model(ARGS, seed=1)
    kernels = compiled_per_layer(model)
    assert 4 <= kernels < ops_per_layer(model)  # q|k|v, o, gate|up and down at least
