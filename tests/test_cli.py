"""decode.py end to end: JSON output, --check, --bench, and one-line errors for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def decode(*args):
    return subprocess.run([sys.executable, str(ROOT / "decode.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def last_json(res):
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_check_json(weights, mode):
    out = last_json(decode("--weights", weights, "--prompt", "def f(x):", "--max-new-tokens", 12,
                           "--mode", mode, "--check", "--json"))
    keys = {"method", "mode", "device", "dtype", "prompt", "text", "token_ids", "new_tokens", "steps",
            "mean_accepted", "tokens_per_s", "seconds", "identical_to_ar"}
    assert keys <= out.keys()
    assert out["identical_to_ar"] is True and out["mode"] == mode and out["method"] == "ar"
    assert 0 < out["new_tokens"] == len(out["token_ids"]) <= 12 and out["steps"] == out["new_tokens"]


def test_sampling_and_no_check(weights):
    a = last_json(decode("--weights", weights, "--max-new-tokens", 8, "--temperature", 1.0, "--top-p", 0.9,
                         "--seed", 4, "--json"))
    b = last_json(decode("--weights", weights, "--max-new-tokens", 8, "--temperature", 1.0, "--top-p", 0.9,
                         "--seed", 4, "--json"))
    assert a["identical_to_ar"] is None and a["token_ids"] == b["token_ids"]


def test_checkpoint_written_by_transformers(tmp_path, weights):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=40)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes((weights / "tokenizer.model").read_bytes())
    out = last_json(decode("--method", "ar", "--weights", tmp_path, "--check", "--json", "--mode", "exact",
                           "--max-new-tokens", 6))
    assert out["identical_to_ar"] is True


def test_bench_json(weights, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]) + "\n")
    out = last_json(decode("--weights", weights, "--bench", "--prompts", prompts, "--methods", "ar",
                           "--max-new-tokens", 8, "--json"))
    assert {"device", "dtype", "mode", "results"} <= out.keys()
    (r,) = out["results"]
    assert r["method"] == "ar" and r["prompts"] == 2 and r["mismatches"] == 0 and r["speedup"] > 0
    assert {"new_tokens", "steps", "mean_accepted", "forward_ms", "tokens_per_s"} <= r.keys() and r["forward_ms"] > 0


@pytest.mark.parametrize("args, message", [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--bench", "--methods", "ar,nope"], "unknown method 'nope'"),
    (["--weights", "/nonexistent/dir"], "no weights directory"),
    (["--prompt-ids", "1,2,99999"], "out of range"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt", "def " * 50, "--max-len", 20], "shorten it or raise --max-len"),
    (["--bench"], "--bench needs --prompts"),
    (["--bench", "--prompts", "/nonexistent.jsonl"], "no prompt file"),
    (["--trace", "/nonexistent/dir/t.jsonl"], "its directory does not exist"),
    (["--bench", "--trace", "t.jsonl"], "--trace records decoding, not --bench"),
    (["--trace", "t.jsonl", "--trace-k", 1], "--trace-k must be at least 2"),
    (["--device", "cuda"], "no CUDA device") if not torch.cuda.is_available() else (["--top-p", "0"], "top-p"),
])
def test_bad_input_gives_one_error_line(weights, args, message):
    res = decode(*(["--weights", weights] if "--weights" not in args else []), *args)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_malformed_config(weights, tmp_path):
    (tmp_path / "config.json").write_text("{\"hidden_size\": 8")
    res = decode("--weights", tmp_path)
    assert res.returncode == 2 and "not valid JSON" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_prompts_file_decodes_each_with_one_drafter(weights, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n", "x = 1"]) + "\n")
    res = decode("--weights", weights, "--prompts", prompts, "--limit", 2, "--max-new-tokens", 6, "--json",
                 "--method", "lookahead:strategy=parallel,decoding_length=4", "--check", "--mode", "exact")
    assert res.returncode == 0, res.stderr
    outs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in outs] == ["def f(x):", "import os\n"]
    assert all(o["identical_to_ar"] is True for o in outs)


def test_bad_method_option_is_one_line(weights):
    res = decode("--weights", weights, "--method", "lookahead:depth=3")
    assert res.returncode == 2 and res.stderr.strip().startswith("error: lookahead has no option 'depth'")
