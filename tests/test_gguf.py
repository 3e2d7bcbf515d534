"""GGUF files: every supported tensor type converts to the model transformers' own GGUF loader
reads (logits within 1e-5, the same greedy tokens), once, into the cache; bad files are refused
with one line and nothing written."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from gguf_files import K_QUANTS, ROOT, transformers_model, write_gguf
from helpers import decode_main, full_logits, run_cli
from nanospec import NanospecError
from nanospec.engine import generate
from nanospec.io.checkpoint import load
from nanospec.io.sources import resolve

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"] + K_QUANTS
PROMPT = [1, 40, 41, 300, 7, 99, 250]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_matches_transformers(tmp_path, qtype):
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, tie=qtype != "Q8_0", seed=len(qtype))
    model = load(resolve(path))
    hf = transformers_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    ours = full_logits(model, PROMPT, exact=False)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    out = generate(model, PROMPT, max_new_tokens=8, eos_id=-1)
    hf_out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    assert out.tokens == hf_out[0, len(PROMPT):].tolist()


def test_converted_once(tmp_path, cache, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", "Q8_0")
    first = resolve(path, log=sys.stderr)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve(path, log=sys.stderr) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert capsys.readouterr().err.count("later runs reuse it") == 1
    assert first.parent.parent == cache and [p.name for p in first.parent.iterdir()] == [first.name]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in first.iterdir()}


def test_convert_cli_writes_a_directory_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / "tiny.gguf", "F16")
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "-m", "nanospec.io.convert", str(path), str(out)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(full_logits(load(out), PROMPT, exact=False), ref, atol=1e-5, rtol=0)


def test_unpermute_inverts_llama_cpp_permute():
    from gguf_files import permute
    from nanospec.io.convert import unpermute
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute(permute(w, 8), 8), w)
    assert not np.array_equal(permute(w, 8), w)


def bad(tmp_path, cache, *args):
    """decode.py in this process (no interpreter start): exit code 2, one error line, nothing in the cache."""
    err = run_cli(decode_main, *args, "--max-new-tokens", 2)
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # nothing half-written
    return err


def test_other_architecture_is_refused(tmp_path, cache):
    path = write_gguf(tmp_path / "moe.gguf", "F32", arch="qwen2moe")
    assert "the GGUF holds a 'qwen2moe' model; nanospec runs the architectures llama, qwen2, qwen3" in bad(
        tmp_path, cache, "--weights", path)


def test_unsupported_tensor_type_is_refused(tmp_path, cache):
    path = write_gguf(tmp_path / "tq.gguf", "TQ2_0")
    assert "TQ2_0, a type nanospec does not load" in bad(tmp_path, cache, "--weights", path)


@pytest.mark.parametrize("damage", ["truncated", "header", "tensor data"])
def test_damaged_file_is_refused(tmp_path, cache, damage):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:len(data) * 2 // 3]
    elif damage == "header":
        data[8:24] = b"\xff" * 16  # the tensor and metadata counts
    else:  # NaN scales in the last tensor's blocks
        data[-4096:] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    msg = bad(tmp_path, cache, "--weights", path)
    assert "corrupted" in msg or "truncated" in msg


def test_unknown_pre_tokenizer_and_missing_merges_are_refused(tmp_path, cache):
    assert "pre-tokenizer 'mystery'" in bad(tmp_path, cache, "--weights",
                                            write_gguf(tmp_path / "a.gguf", pre="mystery"))
    assert "tokenizer.ggml.merges" in bad(tmp_path, cache, "--weights", write_gguf(tmp_path / "b.gguf", merges=False))


def test_convert_refuses_an_existing_directory(tmp_path):
    from nanospec.io.convert import convert
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("")
    with pytest.raises(NanospecError, match="already exists"):
        convert(write_gguf(tmp_path / "tiny.gguf"), tmp_path / "hf")
