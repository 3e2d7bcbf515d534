"""The planted-bug matrix: every class of oracle/plants.py, planted in a tiny random model's engine, is a divergence
by the whole-output test at fp32, at bf16 and under a llama.cpp-wide noise model; correct engines (transformers fp32
and bf16, a modeled llama.cpp at kv f16 and f32, nanospec's own fast mode) are not. The same pipeline judges both,
so each detector is shown to detect and to stay quiet. (The real llama.cpp, where installed: test_llamacpp.py.)

The llama.cpp-wide noise is modeled: the model's matrices round-tripped through Q8_0 (llama.cpp's 8-bit blocks),
computed in fp32 for kv f32 and in fp16 (every activation rounded, wider than an f16 cache alone) for kv f16;
its noise is its own, teacher-forced, as --engine llama.cpp calibrates the real one."""
import math
from dataclasses import replace

import pytest
import torch

from helpers import random_model
from nanospec.engine import generate
from nanospec.model import ModelArgs
from nanospec.oracle import floors, forced, noise, plants, trace, whole

gguf = pytest.importorskip("gguf")

BASE = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, intermediate_size=96, bos_id=1, eos_id=2)
VARIANTS = {"llama": BASE, "scaled": replace(BASE, rope_scaling={"rope_type": "linear", "factor": 4.0}),
            "qwen3": replace(BASE, qk_norm=True), "mistral": replace(BASE, sliding_window=12)}
OF = {"rope_scaling": "scaled", "qk_norm": "qwen3", "window": "mistral"}  # the rest plant in the plain Llama
STRENGTH = {"rope_base": 10.0, "norm_eps": 1e5, "rejected_key": 4, "final_norm_eps": 1e5, "logit_scale": 1.5,
            "softcap": 10.0}
N_NEW = 24


def prompts():
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, BASE.vocab_size, (5,), generator=g).tolist() for _ in range(8)]


def q8_0(model, dtype=torch.float32):
    """The model with every matrix round-tripped through Q8_0 (a copy), in dtype."""
    m = random_model(model.args, seed=0)
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).view_as(p))
    return m.to(dtype)


class Setup:
    """A variant's fp32 reference (its traces, from fast mode: these tests judge the oracle, not exact mode), and
    each noise kind's engine model and noise."""

    def __init__(self, args):
        self.fp32 = random_model(args, seed=3)
        self.prompts = prompts()
        self.refs = [trace.record(p, o.tokens, o.logits, dtype="float32") for p, o in zip(self.prompts, (
            generate(self.fp32, p, max_new_tokens=N_NEW, record_logits=True) for p in self.prompts))]
        self.engines = {"fp32": self.fp32, "bf16": self.fp32_copy(torch.bfloat16),
                        "llama.cpp kv f32": q8_0(self.fp32), "llama.cpp kv f16": q8_0(self.fp32, torch.float16)}
        self.noises = {}

    def fp32_copy(self, dtype):
        m = random_model(self.fp32.args, seed=0)
        m.load_state_dict(self.fp32.state_dict())
        return m.to(dtype)

    def noise(self, kind: str) -> dict:
        if kind not in self.noises:
            model = self.engines[kind]
            self.noises[kind] = noise.measure(self.fp32, model, self.refs, model is self.fp32, kind)
        return self.noises[kind]

    def judge(self, outputs: list, kind: str) -> dict:
        """outputs: per prompt its ids, or (ids, rows): then the engine's top 20 of each row go with them."""
        others = [{"prompt_ids": p, "output_ids": o} if isinstance(o, list) else
                  {"prompt_ids": p, "output_ids": o[0], "positions": noise.positions_of(o[1], 20)}
                  for p, o in zip(self.prompts, outputs)]
        return whole.test(forced.score_run(self.fp32, self.refs, others), self.noise(kind))


@pytest.fixture(scope="module")
def setups():
    return {name: Setup(args) for name, args in VARIANTS.items()}


NOISES = ["fp32", "bf16", "llama.cpp kv f16"]
GROSS = [c for c in plants.CLASSES if c not in plants.SUBTLE]


@pytest.mark.parametrize("kind", NOISES)
@pytest.mark.parametrize("cls", GROSS)
def test_each_planted_class_is_a_divergence(setups, cls, kind):
    """The gross classes, from the engine's ids alone."""
    s = setups[OF.get(cls, "llama")]
    model = s.engines[kind]
    assert plants.applies(cls, model, s.prompts[0])
    outs = [plants.decode(model, p, N_NEW, cls, STRENGTH.get(cls, 1.0)) for p in s.prompts]
    w = s.judge(outs, kind)
    assert w["verdict"] == "divergence" and w["log10_p"] < math.log10(whole.ALPHA), whole.describe(w)


@pytest.mark.parametrize("kind", NOISES)
@pytest.mark.parametrize("cls", plants.SUBTLE)
def test_each_subtle_class_is_a_divergence_with_rows_alone(setups, cls, kind):
    """A subtle class flips no argmax: from ids alone it passes, and says it could see little; from the engine's
    rows (its top 20, as a server's logprobs list them) the distance test makes it a divergence."""
    s = setups["llama"]
    model = s.engines[kind]
    outs = [plants.decode(model, p, N_NEW, cls, STRENGTH[cls], rows=True) for p in s.prompts]
    ids = s.judge([o for o, _ in outs], kind)
    assert ids["verdict"] == "pass" and ids["flips"] == s.judge([plants.decode(model, p, N_NEW) for p in s.prompts],
                                                                kind)["flips"], whole.describe(ids)
    assert "could see little" in whole.caveat(ids)
    w = s.judge(outs, kind)
    assert w["verdict"] == "divergence" and w["log10_p_tests"]["distance"] < math.log10(whole.ALPHA / 4), \
        whole.describe(w)


@pytest.mark.parametrize("variant, kind", [("llama", "llama.cpp kv f32")] + [
    (v, k) for v in ("llama", "qwen3", "mistral") for k in ("fp32", "bf16", "llama.cpp kv f16")])
def test_a_correct_engine_passes(setups, kind, variant):
    """nanospec's fast mode at fp32 and bf16, and the modeled llama.cpp, decoding freely, with their rows: not
    flagged, by the flips or by the distances."""
    s = setups[variant]
    model = s.engines[kind]
    w = s.judge([plants.decode(model, p, N_NEW, rows=True) for p in s.prompts], kind)
    assert w["verdict"] == "pass" and w["distance"] is not None, whole.describe(w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_is_not_flagged(setups, tmp_path, dtype):
    """transformers' own greedy generate on the same weights, in its dtype, against nanospec's noise there."""
    transformers = pytest.importorskip("transformers")
    from nanospec.io.checkpoint import save
    from nanospec.oracle.peers import hf_generate
    s = setups["llama"]
    save(s.fp32, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).eval()
    outs = [hf_generate(hf, p, "greedy", N_NEW, BASE.eos_id) for p in s.prompts]
    w = s.judge(outs, "fp32" if dtype == "float32" else "bf16")
    assert w["verdict"] == "pass", whole.describe(w)


def test_floors_are_reported_for_each_class(setups):
    """At fp32 noise every class that the model has gets a floor within its ladder with rows; from ids alone, the
    gross classes too, and the subtle ones none; those it lacks say so."""
    s = setups["llama"]
    found = floors.floors(s.fp32, s.fp32, s.refs, s.noise("fp32"))
    assert set(found) == set(plants.CLASSES)
    assert {k for k, v in found.items() if v == "n/a"} == {"rope_scaling", "qk_norm", "window"}
    assert found["bos"]["ids"] == "BOS left out" and found["rope_base"]["ids"].startswith("rope base /")
    assert not any(v["rows"].startswith("not flagged") for v in found.values() if v != "n/a"), found
    assert all(found[c]["ids"].startswith("not flagged") for c in plants.SUBTLE), found
    assert not any(found[c]["ids"].startswith("not flagged") for c in plants.CLASSES
                   if c not in plants.SUBTLE and found[c] != "n/a"), found
    assert "with rows: soft cap" in floors.describe(found, "fp32")


def test_tails_are_the_distributions():
    """The tests' tails against direct sums (a wrong tail passes or flags everything)."""
    b = sum(math.comb(20, x) * 0.3 ** x * 0.7 ** (20 - x) for x in range(7, 21))
    assert math.exp(whole.log_binom_sf(7, 20, 0.3)) == pytest.approx(b, rel=1e-9)
    p = 1 - sum(math.exp(-2.5) * 2.5 ** x / math.factorial(x) for x in range(4))
    assert math.exp(whole.log_poisson_sf(4, 2.5)) == pytest.approx(p, rel=1e-9)
    assert whole.log_binom_sf(0, 5, 0.1) == 0.0 and whole.log_poisson_sf(1, 0.0) == -math.inf


def synthetic(flips: list[tuple[int, float]], n: int = 200) -> dict:
    """A prompt's scores: top-2 gaps of 0.5, but at each flip its margin (a flip to the runner-up)."""
    gaps = [0.5] * n
    for i, m in flips:
        gaps[i] = m
    return {"positions": n, "flips": [list(f) for f in flips], "gaps": gaps}


def test_whole_test_on_known_scores():
    """Against a noise of 4 flips in 800 positions at margins up to 0.01, top-2 movements up to 0.01: a run with
    the same flip rate and margins passes; a single flip at margin 0.5 (50x any movement) is a divergence by the
    margin test; 12 flips at the noise's margins in 200 positions are one by the count test (a wrong test fails
    one of the three)."""
    nz = noise.merge([{"positions": 800, "prompts": 4, "flips": 4, "flip_margins": [0.002, 0.004, 0.006, 0.01],
                       "movements": [0.01 * (i % 100) / 100 for i in range(800)], "kl": [0.0]}], "synthetic")
    same = whole.test([synthetic([(50, 0.004)])], nz)
    assert same["verdict"] == "pass" and same["log10_p"] > -1, whole.describe(same)
    far = whole.test([synthetic([(50, 0.5)])], nz)
    assert far["verdict"] == "divergence" and far["log10_p_tests"]["count"] > -1, whole.describe(far)
    many = whole.test([synthetic([(i * 16 + 5, 0.004) for i in range(12)])], nz)
    assert many["verdict"] == "divergence" and many["log10_p_tests"]["count"] < math.log10(whole.ALPHA / 3)


def synthetic_distances(seed: int, prompts: int = 8, n: int = 64, ratio: float = 1.0, agree: float = 0.9,
                        base: int | None = None) -> list:
    """Per-prompt distances as forced.distances keeps them (k = 8): log-normal KLs around 1e-3 with a prompt's own
    level (positions within a prompt move together), times ratio, and top-N agreement at the rate `agree`. base:
    the seed of another such draw whose positions this one shares, each KL moved by its own factor (an engine
    scored at the same positions as a noise sample of the same prompts: the pairing)."""
    g = torch.Generator().manual_seed(seed)
    shared = synthetic_distances(base, prompts, n) if base is not None else None
    out = []
    for p in range(prompts):
        if shared is None:
            kl = torch.exp(0.5 * torch.randn(1, generator=g) + 1.5 * torch.randn(n, generator=g)) * 1e-3
        else:
            kl = torch.tensor(shared[p]["8"]["kl"]) * torch.exp(0.5 * torch.randn(n, generator=g))
        same = (torch.rand(n, generator=g) < agree).int().tolist()
        out.append({"key": f"p{p}", "8": {"kl": (ratio * kl).tolist(), "same": same}})
    return out


def judged(run: list, noise_d: list, positions: int = 64) -> dict:
    scores = [{"positions": positions, "flips": [], "gaps": [1.0] * positions, "key": d["key"], "distances": d}
              for d in run]
    nz = {"source": "synthetic", "positions": len(noise_d) * positions, "flips": 0, "movements": [0.01],
          "distances": noise_d}
    return whole.test(scores, nz)


@pytest.mark.parametrize("paired", [True, False])
def test_the_distance_test_on_known_scores(paired):
    """A run whose mean KL is 4x the noise's, or whose top-N ids leave the reference's four times as often, is a
    divergence by the distance test alone (no flips); a run drawn like the noise is not, and it states the smallest
    KL ratio it flags. Paired: 8 prompts scored at the noise sample's positions; unpaired: 16 prompts against 40
    others (a calibration made on other prompts)."""
    if paired:
        nz, draw = synthetic_distances(0, base=9), lambda **kw: synthetic_distances(1, base=9, **kw)
    else:
        nz = [{**d, "key": "noise " + d["key"]} for d in synthetic_distances(0, prompts=40)]
        draw = lambda **kw: synthetic_distances(1, prompts=16, **kw)
    same = judged(draw(), nz)
    assert same["verdict"] == "pass" and same["distance"]["paired"] == paired, whole.describe(same)
    assert 1 < same["distance"]["smallest_flagged_ratio"] < 4 and whole.caveat(same) is None, whole.describe(same)
    for run in (draw(ratio=4.0), draw(agree=0.6)):
        w = judged(run, nz)
        assert w["verdict"] == "divergence" and w["log10_p_tests"]["distance"] < math.log10(whole.ALPHA / 4), \
            whole.describe(w)
        assert w["log10_p_tests"]["count"] == 0
    ids_only = whole.test([{"positions": 64, "flips": [], "gaps": [1.0] * 64}],
                          {"source": "s", "positions": 64, "flips": 0, "movements": [0.01], "distances": nz})
    assert ids_only["distance"] is None and "could see little: ids only" in whole.caveat(ids_only)


@pytest.mark.parametrize("paired", [True, False])
def test_false_alarms_by_resampling_the_noise(paired):
    """1,000 correct runs of 8 prompts, each judged against a noise: none is a divergence (a correct engine's
    false-alarm rate below 1 in 1,000), and their distance p-values are not far below uniform (at most 3% under
    0.01). Paired: each run and its noise drawn at the same positions of a pool prompt; unpaired: a run's prompts
    drawn from a 40-prompt pool, judged against the other 32."""
    pool = synthetic_distances(7, prompts=40)
    g = torch.Generator().manual_seed(1)
    ps = []
    for r in range(1000):
        order = torch.randperm(40, generator=g).tolist()
        if paired:
            base = [pool[i] for i in order[:8]]
            jitter = lambda d, s: [{**x, "8": {**x["8"], "kl": (torch.tensor(x["8"]["kl"]) * torch.exp(
                0.5 * torch.randn(64, generator=g))).tolist()}} for x in d]
            w = judged(jitter(base, r), jitter(base, r))
        else:
            w = judged([pool[i] for i in order[:8]], [pool[i] for i in order[8:]])
        ps.append(10 ** w["log10_p_tests"]["distance"])
        assert w["verdict"] == "pass", whole.describe(w)
    assert sum(p < 0.01 for p in ps) <= 30


def test_the_classes_table_command(capsys):
    """`python -m nanospec.oracle.floors` on the shipped model: the rounding line, then one line per class, each
    with its flips, KL and floors from ids and with rows (or why it has none)."""
    floors.main(["--limit", "2", "--max-new-tokens", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bfloat16 rounding: ") and len(lines) == 1 + len(plants.CLASSES)
    assert all(("from ids" in line and "with rows" in line) or line.endswith("not in this model or its prompts")
               for line in lines[1:])
