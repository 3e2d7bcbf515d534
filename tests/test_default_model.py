"""The shipped default model (weights/pylm): loads everywhere, fits the size budget, decodes exactly."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import FIGURES, SHIPPED, Adversary, check_exact, full_logits
from helpers import PYLM as W
from nanospec.bench import load_prompts
from nanospec.engine import generate, shapes
from nanospec.io import checkpoint
from nanospec.io.checkpoint import load
from nanospec.io.tokenizer import Tokenizer
from nanospec.methods import load_drafter

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def model():
    return load(W)


def test_size_budget():
    assert (W / "model.safetensors").stat().st_size < 17 * 2**20
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=ROOT).stdout.split(b"\0")
    total = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    assert total < 56 * 2**20, f"repository is {total / 2**20:.1f} MiB, over the 56 MiB budget"


def test_stored_bf16_and_upcast_is_exact(model):
    cfg = json.loads((W / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    bf = load(W, torch.bfloat16)
    for (n, a), (_, b) in zip(model.state_dict().items(), bf.state_dict().items()):
        assert torch.equal(a, b.float()), n


def test_transformers_gives_the_same_logits(model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(W, dtype=torch.float32).eval()
    ids = Tokenizer(W / "tokenizer.model").encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = full_logits(model, ids, exact=False)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_tree_decoding_on_the_default_model(dtype, device):
    model = load(W, dtype).to(device)
    prompt = Tokenizer(W / "tokenizer.model").encode(PROMPT)
    Q, S, tail = shapes([Adversary([], 1, max_nodes=12)], len(prompt), 24)
    kw = dict(max_new_tokens=24, exact=True, Q=Q, n_slots=S, tail=tail, eos_id=-1, record_logits=True)
    ar = generate(model, prompt, **kw)
    adv = generate(model, prompt, Adversary(ar.tokens, model.args.vocab_size, seed=1), **kw)
    assert adv.tokens == ar.tokens and torch.equal(adv.logits, ar.logits) and adv.steps < ar.steps


def test_every_shipped_drafter_is_tested(monkeypatch):
    """SHIPPED reads every drafter file under weights/ (and names every method that decodes the default model)."""
    files = {f.name for f in W.glob("*.safetensors")} - {"model.safetensors"}
    model, read, safe_open = load(W), set(), checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda path, *a, **k: read.add(Path(path).name) or safe_open(path, *a,
                                                                                                               **k))
    for spec in SHIPPED:
        load_drafter(spec, model, W)
    assert read == files


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SHIPPED)
def test_shipped_drafters_are_exact_and_accept(spec, dtype, device):
    """Each method's shipped weights: bitwise AR in exact mode, and drafts do get accepted
    (non-vacuous); a pruning drafter (ProPD's early head) does prune rows. bf16, the slower run on a CPU, decodes
    half as many tokens (every method still accepts drafts)."""
    model = load(W, dtype).to(device)
    d = load_drafter(spec, model, W)
    prompt = Tokenizer(W / "tokenizer.model").encode('def add(a, b):\n    """Return a + b."""\n')
    pruned, (n, floor) = [], (32, 1.2) if dtype == torch.float32 else (16, 1.1)
    out = check_exact(model, prompt, d, n, fast=False, on_step=lambda dec, step: pruned.extend(step.pruned))
    assert out.tokens_per_step > floor
    assert pruned or not d.prunes


def tokens_per_step(spec: str) -> float:
    model = load(W)
    tok = Tokenizer(W / "tokenizer.model")
    tokens = steps = 0
    for text in load_prompts(W / "prompts.jsonl")[:4]:
        prompt = tok.encode(text)
        d = load_drafter(spec, model, W)
        Q, S, tail = shapes([d], len(prompt), 64)
        out = generate(model, prompt, d, max_new_tokens=64, Q=Q, n_slots=S, tail=tail, eos_id=-1)  # fast mode
        tokens, steps = tokens + len(out.tokens), steps + out.steps
    return tokens / steps


@pytest.mark.parametrize("spec", FIGURES)
def test_shipped_drafters_keep_their_draft_quality(spec):
    """Draft quality, which the exactness tests cannot see (a worse draft is still exact): each
    shipped drafter's tokens per step stays within 10% of its measured figure (weights/pylm/tokens_per_step.json).
    A drafter that gains as much fails too: then its weights or its code changed, and the figure is updated on
    purpose. Decoded in fast mode, the cheaper run, whose tokens are AR's too (the fast-mode test)."""
    measured = tokens_per_step(spec)
    assert 0.9 * FIGURES[spec] <= measured <= 1.1 * FIGURES[spec], measured


@pytest.mark.parametrize("spec", SHIPPED)
def test_shipped_drafters_in_fast_mode_give_ar_tokens(spec, device):
    """Fast mode (the CPU default and the benchmark's): AR's tokens on a held-out prompt, fp32."""
    model = load(W).to(device)
    d = load_drafter(spec, model, W)
    prompt = Tokenizer(W / "tokenizer.model").encode(load_prompts(W / "prompts.jsonl")[0])
    Q, S, tail = shapes([d], len(prompt), 32)
    kw = dict(max_new_tokens=32, Q=Q, n_slots=S, tail=tail)
    out, ar = generate(model, prompt, d, **kw), generate(model, prompt, **kw)
    assert out.tokens == ar.tokens and len(out.tokens) == 32
    assert out.steps < 32  # drafts were accepted


def test_decode_py_uses_it_by_default(device):
    res = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--method", "ar", "--prompt", "def fibonacci(n):",
                          "--max-new-tokens", "24", "--check", "--json", "--device", device],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["identical_to_ar"] is True and out["text"] and res.stdout.startswith("def fibonacci(n):")


if __name__ == "__main__":  # the figures weights/pylm/tokens_per_step.json pins
    print(json.dumps({spec: round(tokens_per_step(spec), 3) for spec in FIGURES}, indent=1))
