"""CUDA graphs, exact mode's fast path on a GPU: a replay gives the eager forward's logits bitwise,
graphs are captured once and reused across generations, and a step's forward never syncs."""
import pytest
import torch

from helpers import Adversary, random_model
from nanospec import graphs
from nanospec.engine import Drafter, generate, shapes
from nanospec.model import ModelArgs

cuda = pytest.mark.cuda
ARGS = ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, hidden_dim=80)


def run(model, prompt, drafter=None, n=24):
    Q, S = shapes([Adversary([], 1, max_nodes=12, extra_rows=3)], len(prompt), n)
    return generate(model, prompt, drafter, max_new_tokens=n, exact=True, Q=Q, n_slots=S, eos_id=-1,
                    record_logits=True)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_bitwise(dtype, monkeypatch):
    model = random_model(ARGS, 0, dtype, "cuda")
    prompt = list(range(1, 40))
    ar = run(model, prompt)
    adv = run(model, prompt, Adversary(ar.tokens, ARGS.vocab_size, seed=1, extra_rows=3))
    monkeypatch.setattr(graphs, "ENABLED", False)
    eager = run(model, prompt)
    assert eager.tokens == ar.tokens == adv.tokens
    assert torch.equal(eager.logits, ar.logits) and torch.equal(adv.logits, ar.logits)


@cuda
def test_graphs_are_captured_once_per_shape():
    model = random_model(ARGS, 0, torch.float32, "cuda")
    run(model, list(range(1, 20)))
    (cache,) = model._exact_caches.values()
    n = len(cache.graphs)
    run(model, list(range(3, 22)))  # another prompt of the same cache size
    assert len(model._exact_caches) == 1 and len(cache.graphs) == n


class NoSync(Drafter):
    """AR whose verification forward fails on any host-device sync."""

    def forward(self, dec, tree):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return dec.run(tree.block(dec.cur))
        finally:
            torch.cuda.set_sync_debug_mode("default")


@cuda
def test_exact_forward_does_not_sync():
    model = random_model(ARGS, 0, torch.float32, "cuda")
    prompt = list(range(1, 20))
    ar = run(model, prompt)  # captures the graphs (capturing syncs)
    assert run(model, prompt, NoSync()).tokens == ar.tokens


def test_exact_blocks_have_fixed_shapes():
    """What a graph needs, checked on any device: every exact forward's inputs have the same shapes."""
    model = random_model(ARGS, 0, torch.float32, "cpu")
    seen = set()

    class Spy(Adversary):
        def forward(self, dec, tree):
            seen.add(tuple(tuple(t.shape) for t in dec.fixed(tree.block(dec.cur))))
            return super().forward(dec, tree)

    ar = run(model, list(range(1, 30)))
    run(model, list(range(1, 30)), Spy(ar.tokens, ARGS.vocab_size, seed=2, extra_rows=3))
    assert len(seen) == 1
