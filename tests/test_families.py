"""The families beside Llama, from tiny random checkpoints that transformers itself wrote (save_pretrained):
Mistral (a sliding window shorter than the prompts), Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k
norms, its own head_dim). Each loads, its logits are transformers' (fp32: within 1e-5; bf16: within its rounding),
its greedy ids are transformers' generate's, its decode --check and `compare --engine transformers` say identical,
and its GGUF goes out and back unchanged, as llama.cpp lays it out. Each planted fault (a bias left out, the q/k
norm after RoPE, the window one off) is caught; other model types are refused in one line."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import (
    ARGS,
    DRAFTING,
    HF_FAMILIES,
    ROOT,
    call,
    decode_main,
    family_args,
    full_logits,
    hf_family,
    random_model,
    run_cli,
)
from nanospec import NanospecError
from nanospec import model as llama
from nanospec.engine import generate
from nanospec.io.checkpoint import from_hf_config, load, load_args, load_tensors, save, to_hf_config
from nanospec.methods import load_drafter
from nanospec.model import ModelArgs
from nanospec.oracle import compare

transformers = pytest.importorskip("transformers")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
IDS = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(1))  # 5 windows of Mistral's 8
PROMPTS = ["def fibonacci(n):\n    if n < 2:", "class Cache:\n    def get(self, key):"]


def training_free(name) -> bool:
    """Whether the method decodes a checkpoint that has no drafter files (tests/ holds none)."""
    try:
        load_drafter(name, random_model(ARGS), ROOT / "tests")
    except NanospecError:
        return False
    return True


FREE = [n for n in DRAFTING if training_free(n)]  # the methods a random family checkpoint decodes with


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers' model, its directory), written once."""
    out = {}
    for name in HF_FAMILIES:
        path = tmp_path_factory.mktemp(name)
        out[name] = hf_family(path, name), path
    return out


def logits_gap(hf, ours, exact: bool) -> float:
    """max |ours - transformers'| over IDS's positions."""
    with torch.no_grad():
        ref = hf(IDS).logits[0].float()
    return (full_logits(ours, IDS[0].tolist(), exact).float() - ref).abs().max().item()


def same_config(a: ModelArgs, b: ModelArgs) -> bool:
    """The same model: head_dim given or implied, norm_eps as fp32 adds it (GGUF stores it in fp32)."""
    norm = lambda x: replace(x, head_dim=x.hd, norm_eps=float(np.float32(x.norm_eps)))
    return norm(a) == norm(b)


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_logits_are_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    ours = load(path)
    assert ours.args.sliding_window == HF_FAMILIES[name][1].get("sliding_window")
    assert logits_gap(hf, ours, exact=True) <= 1e-5 and logits_gap(hf, ours, exact=False) <= 1e-5
    # bf16: each side rounds at every op, so they differ by a few of its epsilons at the logits' scale
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    scale = full_logits(ours, IDS[0].tolist(), False).abs().max().item()
    assert logits_gap(hf16, load(path, torch.bfloat16), exact=True) <= 4 * 2 ** -7 * scale


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_ids_are_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    ours, prompt = load(path), IDS[:, :9]
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, 9:].tolist()
    for exact in (False, True):
        assert generate(ours, prompt[0].tolist(), max_new_tokens=20, exact=exact, eos_id=-1).tokens == ref


def test_planted_faults_are_caught(checkpoints, monkeypatch):
    """The logits check catches a Qwen2 bias left out, Mistral's window one slot off either way, and Qwen3's q/k norm
    applied after RoPE instead of before it."""
    hf, path = checkpoints["qwen2"]
    ours = load(path)
    with torch.no_grad():
        ours.layers[1].attn.qkv.bias.zero_()
    assert logits_gap(hf, ours, exact=True) > 1e-2
    hf, path = checkpoints["mistral"]
    for off in (-1, 1):
        ours = load(path)
        ours.args.sliding_window += off
        assert logits_gap(hf, ours, exact=True) > 1e-2 and logits_gap(hf, ours, exact=False) > 1e-2
    hf, path = checkpoints["qwen3"]
    norm, rope, pending = llama.rms_norm, llama.apply_rope, []

    def unweighted(x, weight, eps):  # q's and k's norm (B, T, Hkv, G + 1, D) without its weight, which follows RoPE
        if x.dim() == 3:  # a layer's norm
            return norm(x, weight, eps)
        pending.append(weight)
        return norm(x, torch.ones_like(weight), eps)
    monkeypatch.setattr(llama, "rms_norm", unweighted)
    monkeypatch.setattr(llama, "apply_rope", lambda x, cos, sin: pending.pop() * rope(x, cos, sin))
    assert logits_gap(hf, load(path), exact=True) > 1e-2


@pytest.mark.parametrize("name, window", [(f, 8) for f in FAMILIES] + [("qwen2", None), ("qwen3", None)])
def test_our_checkpoints_of_each_family_load_in_transformers(tmp_path, name, window):
    """save() writes the family's config.json (Qwen's window: every layer's), which transformers loads unchanged."""
    args = family_args(ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=33,
                                 intermediate_size=30), name, window)
    args = replace(args, sliding_window=window if name != "llama" else None)
    assert from_hf_config(to_hf_config(args)) == args
    model = random_model(args)
    save(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == HF_FAMILIES[name][0].replace("Config", "ForCausalLM")
    ids = list(range(33))
    torch.testing.assert_close(full_logits(model, ids, False), hf(torch.tensor([ids])).logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("method", FREE)
def test_decode_check_is_identical(checkpoints, method, name, dtype):
    _, path = checkpoints[name]
    code, out, err = call(decode_main, "--weights", path, "--method", method, "--mode", "exact", "--check",
                          "--dtype", dtype, "--prompt", PROMPTS[0], "--max-new-tokens", 16, "--json")
    assert code == 0 and "identical" in err, err
    assert json.loads(out.splitlines()[-1])["identical_to_ar"] is True


def test_chat_template_renders_and_ends_the_turn_at_its_token(checkpoints):  # decode --chat: test_chat.py
    from nanospec.io import chat
    from nanospec.io.tokenizer import load_tokenizer
    _, path = checkpoints["qwen3"]
    tok = load_tokenizer(path)
    ids, end = chat.prompt_ids(path, tok, "Say hi.")
    assert ids[0] == tok.token_id("<|im_start|>") and end == tok.token_id("<|im_end|>")


@pytest.mark.parametrize("name", FAMILIES)
def test_compare_with_transformers_is_identical(checkpoints, name, tmp_path):
    _, path = checkpoints[name]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    code, out, err = call(compare.main, "--engine", "transformers", "--weights", path, "--prompts", prompts,
                          "--dtype", "float32", "--settings", "greedy", "--max-new-tokens", 16, "--json")
    assert code == 0, out + err
    (run,) = json.loads(out.splitlines()[-1])["runs"]
    assert run["summary"]["identical"] == len(PROMPTS), out


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_round_trip(checkpoints, name, tmp_path, monkeypatch):
    """DIR -> F32 GGUF -> DIR: the same tensors, config and tokenizer. The GGUF is laid out as llama.cpp's converter
    lays the family out (Q and K rows permuted for its `llama` only), and transformers' own GGUF reader gets the
    model from it."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import permute
    from nanospec.io import convert
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    hf, src = checkpoints[name]
    code, _, err = call(convert.main, src, tmp_path / "m.gguf")
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"mistral": "llama"}.get(name, name)
    stored = {t.name: t.data.reshape(tuple(reversed([int(n) for n in t.shape]))) for t in reader.tensors}
    q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert (stored["blk.0.attn_q.weight"] == (permute(q, 4) if arch == "llama" else q)).all()
    assert ("blk.0.attn_q.bias" in stored) == (name == "qwen2") and ("blk.0.attn_k_norm.weight" in stored) == (
        name == "qwen3")
    back = convert.convert(tmp_path / "m.gguf", tmp_path / "back")
    x, y = load_tensors(src), load_tensors(back)
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert same_config(load_args(back), load_args(src))
    assert json.loads((back / "tokenizer.json").read_text()) == json.loads((src / "tokenizer.json").read_text())
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ids = IDS[:, :8]  # within Mistral's window: transformers' reader of a `llama` GGUF knows no window
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config, says", [
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention"]}, "a sliding window on some layers only"),
])
def test_other_models_are_refused_in_one_line(checkpoints, tmp_path, config, says):
    _, src = checkpoints["qwen2"]
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    assert says in run_cli(decode_main, "--weights", tmp_path, "--max-new-tokens", 2)
