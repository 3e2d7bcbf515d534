"""CUDA graphs, exact mode's fast path on a GPU: a replay gives the eager step's logits bitwise,
graphs are captured once and reused, and a step's device program never syncs.

Without a GPU the same properties are checked through graphs.Simulated: every exact-mode program
is traced once into its tensor ops (host syncs refused) and replayed without its Python, as a
captured graph would be. A method whose forward reads state its graph key does not name, or
syncs, fails there."""
import pytest
import torch

from helpers import ARGS as EDGE_ARGS
from helpers import METHODS, Adversary, drafter, family_args, feed, random_model, use_programs
from nanospec import engine, verify
from nanospec import programs as graphs
from nanospec.engine import Drafter, generate, shapes
from nanospec.methods import hidden_transfer
from nanospec.model import ModelArgs

cuda = pytest.mark.cuda
ARGS = ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, intermediate_size=80)


def run(model, prompt, drafter=None, n=24):
    Q, S, W = shapes([Adversary([], 1, max_nodes=12, extra_rows=3)], len(prompt), n)
    return generate(model, prompt, drafter, max_new_tokens=n, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1,
                    record_logits=True)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_bitwise(dtype, monkeypatch):
    use_programs(monkeypatch, "cuda", graphs.Graphs())
    model = random_model(ARGS, 0, dtype, "cuda")
    prompt = list(range(1, 40))
    ar = run(model, prompt)
    adv = run(model, prompt, Adversary(ar.tokens, ARGS.vocab_size, seed=1, extra_rows=3))
    use_programs(monkeypatch, "cuda", None)
    eager = run(model, prompt)
    assert eager.tokens == ar.tokens == adv.tokens
    assert torch.equal(eager.logits, ar.logits) and torch.equal(adv.logits, ar.logits)


@cuda
def test_graphs_are_captured_once_per_shape(monkeypatch):
    g = graphs.Graphs()
    use_programs(monkeypatch, "cuda", g)
    model = random_model(ARGS, 0, torch.float32, "cuda")
    run(model, list(range(1, 20)))
    (cache,) = g.caches[model].values()
    n = len(g.graphs[cache])
    run(model, list(range(3, 22)))  # another prompt of the same cache size
    assert len(g.caches[model]) == 1 and len(g.graphs[cache]) == n


@cuda
def test_exact_step_does_not_sync(monkeypatch):
    use_programs(monkeypatch, "cuda", graphs.Graphs())
    model = random_model(ARGS, 0, torch.float32, "cuda")
    prompt = list(range(1, 20))
    ar = run(model, prompt)  # captures the graphs (capturing syncs)
    program = engine.launch_step

    def strict(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return program(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(engine, "launch_step", strict)
    assert run(model, prompt).tokens == ar.tokens


# --- the same, simulated on the CPU --------------------------------------------------------------

@pytest.fixture
def simulate(monkeypatch):
    use_programs(monkeypatch, "cpu", graphs.Simulated())


@pytest.mark.parametrize("name, family", [(n, "llama") for n in METHODS + ["adversary"]] + [("adversary", "all")])
def test_every_method_replays_as_a_graph(name, family, monkeypatch):
    """Each method's exact step, traced once per graph key and replayed: AR's logits bitwise, with
    drafts accepted; no op inside reads a device value on the host. Also with every family's switches
    (q/k/v biases, q/k norms, a window shorter than the prompt)."""
    model = random_model(family_args(EDGE_ARGS, family), seed=11)
    prompt = [3, 9, 4, 1, 7, 12, 5] * 2
    Q, S, _ = shapes([drafter(n, model) for n in METHODS], len(prompt), 24)
    kw = dict(max_new_tokens=24, exact=True, Q=Q, n_slots=S, tail=Q, eos_id=-1, record_logits=True)  # any path fits
    ar = generate(model, prompt, **kw)
    if name == "adversary":
        d = Adversary(ar.tokens, EDGE_ARGS.vocab_size, seed=3, extra_rows=3, reserved=2)
    else:
        d = feed(drafter(name, model), [prompt], [ar], 0.9, seed=2)
    sim, keys = graphs.Simulated(), set()
    use_programs(monkeypatch, "cpu", sim)
    real = sim.run

    def spy(cache, key, fn, args, device):
        keys.add(key)
        return real(cache, key, fn, args, device)
    monkeypatch.setattr(sim, "run", spy)
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits)
    assert out.tokens_per_step > 1.5 or d.max_rows == 1  # drafts accepted (AR drafts none)
    steps = [k for k in keys if k[0] == "step"]
    if type(d).groups is Drafter.groups:
        assert len(steps) == 1  # no rows after the tree: one graph for every tree, shapes fixed, the tree is data
    elif name == "adversary":  # its rows after the tree start at the largest tree's n: a graph per n
        assert len(steps) == len({k[2] for k in steps}) > 1


@pytest.mark.parametrize("name", METHODS)
def test_sampled_steps_replay_as_graphs(name, monkeypatch):
    """A sampled step's program returns the logits and what the method drafts (None where it drafts
    nothing): replayed, it samples what AR samples, bit for bit (on an H100 its None crashed the replay)."""
    model = random_model(EDGE_ARGS, seed=11)
    prompt = [3, 9, 4, 1, 7, 12, 5]
    Q, S, _ = shapes([drafter(n, model) for n in METHODS], len(prompt), 16)
    kw = dict(max_new_tokens=16, exact=True, Q=Q, n_slots=S, tail=Q, eos_id=-1, record_logits=True, temperature=1.0,
              top_p=0.9, seed=3)  # tail: any path fits the block
    ar = generate(model, prompt, **kw)
    d = feed(drafter(name, model), [prompt], [ar], 0.9, seed=2)
    use_programs(monkeypatch, "cpu", graphs.Simulated())
    out = generate(model, prompt, d, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits)


def test_a_program_that_syncs_is_refused(simulate):
    class Syncing(Adversary):
        def forward(self, f, nodes):
            out = super().forward(f, nodes)
            if int(out.logits[0].argmax()) >= 0:  # a host read: illegal in a CUDA graph
                return out
    model = random_model(ARGS, 0)
    with pytest.raises(RuntimeError, match="not allowed in a CUDA graph"):
        run(model, list(range(1, 10)), Syncing([], ARGS.vocab_size))


def test_a_forward_reading_unkeyed_state_is_caught(simulate):
    """A forward whose result depends on Python state its key does not name replays stale values:
    the simulation reproduces what a real graph would do, so exactness tests catch it."""
    class Stale(Adversary):
        def start(self, dec):
            super().start(dec)
            self.k = 0

        def draft(self, dec, *a):
            self.k += 1
            return super().draft(dec, *a)

        def forward(self, f, nodes):
            out = super().forward(f, nodes)
            out.logits[0, self.k % 7] += 1e4  # makes token k % 7 win: the key would need k
            return out
    model = random_model(ARGS, 0)
    eager = [t % 7 for t in range(1, 9)]
    assert run(model, list(range(1, 10)), Stale([], ARGS.vocab_size), n=8).tokens != eager


# --- what a capture refuses, refused by the stand-in -----------------------------------------------

class Planted(Adversary):
    """An Adversary whose verification forward also runs plant(logits)."""

    def __init__(self, plant, *a, **k):
        super().__init__(*a, **k)
        self.plant = plant

    def forward(self, f, nodes):
        out = super().forward(f, nodes)
        out.logits = self.plant(out.logits)
        return out


def written(x):
    x[:, 0, 0] = 1.0  # a Python scalar written by index: a host value copied in
    return x


@pytest.mark.parametrize("plant, what", [
    (lambda x: x + torch.tensor(0.0), "torch.tensor makes a tensor without a device .* copies a host value in"),
    (written, "lift_fresh copies a host value in"),
    (lambda x: x + torch.zeros(x.shape[-1], dtype=x.dtype), "torch.zeros makes a tensor without a device"),
    (lambda x: x * float(x.sum() > 0), "reads a device value on the host")])
def test_what_a_capture_refuses_is_refused_with_its_line(simulate, plant, what):
    model = random_model(ARGS, 0)
    with pytest.raises(RuntimeError, match=what) as e:
        run(model, list(range(1, 10)), Planted(plant, [], ARGS.vocab_size))
    assert "not allowed in a CUDA graph" in str(e.value)
    assert what.startswith("reads") or "test_graphs.py" in str(e.value)  # the line that did it


@pytest.mark.parametrize("factory", [torch.zeros, torch.ones, torch.empty, torch.arange])
def test_a_factory_given_device_none_is_refused(factory):
    """device=None names no device: the tensor lands on the host, as one made without the keyword does."""
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match=f"torch.{factory.__name__} makes a tensor without a device"):
        graphs.Traced(lambda x: x + factory(3, device=None), [x], "cpu")
    graphs.Traced(lambda x: x + factory(3, device=x.device), [x], "cpu")  # given its device: traced


@pytest.mark.parametrize("name", METHODS)
def test_a_host_constant_planted_in_any_step_program_is_refused(name, simulate):
    model = random_model(EDGE_ARGS, seed=11)
    d = drafter(name, model)
    forward = d.forward

    def planted(f, nodes):
        out = forward(f, nodes)
        out.logits = out.logits + torch.tensor(0.0, device=out.logits.device)  # made there, from a host value
        return out
    d.forward = planted
    with pytest.raises(RuntimeError, match="lift_fresh copies a host value in"):
        run(model, [3, 9, 4, 1, 7], d, n=4)


def root_written(accept):
    """verify.accept with its root flag written by index, as it was: a Python scalar put into a device mask. The
    mask it writes is accept's own (the root, row 0, accepted), passed on as `alive`, so the result is unchanged."""
    def planted(tokens, lay, logits, alive=None):
        ok = tokens == logits.argmax(-1).gather(1, lay.parent.clamp(min=0))
        ok[:, 0] = True  # the host write
        return accept(tokens, lay, logits, ok if alive is None else ok & alive)
    return planted


def rows_written(transfer):
    """Hidden Transfer's step with its active rows written by index, as they were: a Python scalar put into a
    device mask of the pseudo rows, before the step runs."""
    def planted(f, tr, x, hosts, rows, record=None):
        active = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
        active[torch.cat(rows)] = False  # the host write
        return transfer(f, tr, x, hosts, rows, record)
    return planted


@pytest.mark.parametrize("module, name, plant", [(verify, "accept", root_written),
                                                 (hidden_transfer, "transfer", rows_written)])
def test_the_host_writes_an_h100_found_are_caught_when_planted_back(simulate, monkeypatch, module, name, plant):
    """The two host writes that crashed every method's CUDA default at capture (verify.accept's root flag, Hidden
    Transfer's active rows), planted back where the step looks its function up: the stand-in refuses them, and
    passes the step without them."""
    def decode():  # a fresh model each time: no program traced before
        model = random_model(EDGE_ARGS, seed=11)
        d = drafter("hidden_transfer", model)
        Q, S, W = shapes([d], 5, 4)
        return generate(model, [3, 9, 4, 1, 7], d, max_new_tokens=4, exact=True, Q=Q, n_slots=S, tail=W, eos_id=-1)
    assert len(decode().tokens) == 4  # as shipped: traced and replayed
    monkeypatch.setattr(module, name, plant(getattr(module, name)))
    with pytest.raises(RuntimeError, match="lift_fresh copies a host value in"):
        decode()


def test_the_bench_copies_drafters_without_their_graphs(simulate, monkeypatch):
    """The bench copies each drafter after graphs exist (warm-up, a batch's second pass, the kernel timing): the runs
    still match AR. A copy shares the model's modules it borrows (drafter.Borrowed), never copies them: a copy
    of the model would double its memory; planted (a plain list), the copy holds a model of its own."""
    import copy

    from nanospec.bench import bench
    from nanospec.methods import medusa
    model = random_model(EDGE_ARGS, seed=11)
    names = ["medusa", "sdsat"]  # drafters with trained modules, Medusa's heads borrowing the model's (ProPD's too)
    prompts = [[3, 9, 4, 1, 7, 12, 5], [5, 2, 8, 8, 1, 12, 30, 4, 11, 2, 6, 1]]
    kw = dict(exact=True, max_new_tokens=8, eos_id=-1, batch=2)
    res = bench(model, prompts, [drafter(n, model) for n in names], **kw)
    assert [r["mismatches"] for r in res] == [0] * len(names) and all(r["new_tokens"] for r in res)
    shares = lambda: copy.deepcopy(drafter("medusa", model)).heads.shared[0] is model.lm_head
    assert shares()
    monkeypatch.setattr(medusa, "Borrowed", list)  # the planted fault
    assert not shares()
