"""--engine llama.cpp through llama-cpp-python (skipped where it is not installed; CI does not build
it): on a tiny F32 model exported here, every setting and KV cache type is judged with the
calibration the run measures, which a second run reuses from its file; llama-cpp-python's own
server is checked through --engine openai. Without the package: one line naming the install."""
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from gguf_files import ascii_model
from helpers import call, run_cli
from nanospec.io.gguf_export import export
from nanospec.oracle import calibration as cal
from nanospec.oracle import compare


def test_missing_llama_cpp_python_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    msg = run_cli(compare.main, "--engine", "llama.cpp")
    assert "needs llama-cpp-python" in msg and 'pip install "nanospec[llamacpp]"' in msg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    d = ascii_model(tmp_path_factory.mktemp("llamacpp"))
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):\n    return", "import os\n"]))
    return d, prompts


def test_every_setting_with_its_measured_calibration(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    d, prompts = tiny
    common = ["--engine", "llama.cpp", "--weights", d, "--prompts", prompts, "--max-new-tokens", 12, "--json"]
    code, out, err = call(compare.main, *common, "--save", tmp_path / "s", "--save-calibration", tmp_path / "c.json")
    assert code == 0, out + err
    runs = json.loads(out.splitlines()[-1])["runs"]
    (tok,) = [r for r in runs if r.get("check") == "tokenizer"]
    assert tok["differ"] == 0 and tok["prompts"] == 2
    judged = [(r["setting"], r["kv"], r["against"]) for r in runs if "results" in r]
    assert judged == [(s, kv, a) for kv in ("f16", "f32") for s, a in (
        ("greedy", "reference"), ("prompt_lookup", "reference"), ("prompt_lookup", "greedy"),
        ("draft", "reference"), ("draft", "greedy"))]
    assert all(r["summary"]["divergence"] == 0 and r["calibrated"] for r in runs if "results" in r)
    assert all(r["tokens_per_s"] > 0 for r in runs if r.get("against") == "reference")
    c = cal.read(tmp_path / "c.json")
    assert sorted(c["settings"]) == sorted(f"{n} kv={kv}" for n in ("single", "batched", "self")
                                           for kv in ("f16", "f32"))
    assert c["engine"] == "llama.cpp" and all(e["units"] == "float32" for e in c["settings"].values())
    assert "calibration: llama.cpp single kv=f16: top-2 gaps move by at most" in out
    saved = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert "nanospec-ar-float32.jsonl" in saved and "llama.cpp-draft-kvf32.jsonl" in saved
    # a second run: the reference and the calibration from the files, nothing measured again
    code, out, err = call(compare.main, tmp_path / "s" / "nanospec-ar-float32.jsonl", *common, "--calibration",
                          tmp_path / "c.json", "--settings", "greedy", "--kv", "f32")
    assert code == 0, err
    assert "calibration:" not in out and "nanospec ar exact" not in err
    (run,) = [r for r in json.loads(out.splitlines()[-1])["runs"] if "results" in r]
    assert run["ulps"] == c["settings"]["single kv=f32"]["ulps"]


def test_sequences_batched_in_one_context_are_judged_against_each_alone(tiny, tmp_path, monkeypatch):
    """--batch 2: the two prompts as sequences 0 and 1 of one context, one llama_decode per step over
    both, judged against the reference and against each prompt's lone greedy run (its own rows)."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    d, prompts = tiny
    code, out, err = call(compare.main, "--engine", "llama.cpp", "--weights", d, "--prompts", prompts,
                          "--max-new-tokens", 12, "--settings", "prompt_lookup", "--kv", "f32", "--batch", 2,
                          "--save", tmp_path / "s", "--json")
    assert code == 0, out + err
    runs = [r for r in json.loads(out.splitlines()[-1])["runs"] if "results" in r]
    judged = [(r["setting"], r["against"]) for r in runs]
    assert judged == [("greedy", "reference"), ("greedy batch 2", "reference"), ("greedy batch 2", "alone"),
                      ("prompt_lookup", "reference"), ("prompt_lookup", "greedy")]
    batch = [r for r in runs if r["setting"] == "greedy batch 2"]
    assert all(len(r["results"]) == 2 and r["summary"]["divergence"] == 0 and r["summary"]["empty"] == 0 for r in batch)
    alone, together = ([json.loads(line) for line in (tmp_path / "s" / f"llama.cpp-{n}-kvf32.jsonl").open()]
                       for n in ("greedy", "batch2"))
    assert [e["prompt_ids"] for e in together] == [e["prompt_ids"] for e in alone]
    assert all(len(e["output_ids"]) == len(e["positions"]) > 0 for e in together)


def test_bad_llama_cpp_options(tiny):
    d, prompts = tiny
    assert "unknown --kv 'q8'" in run_cli(compare.main, "--engine", "llama.cpp", "--weights", d, "--kv", "q8")
    assert "unknown setting 'assisted'" in run_cli(compare.main, "--engine", "llama.cpp", "--settings", "assisted")
    assert "no --dtype" in run_cli(compare.main, "--engine", "llama.cpp", "--dtype", "bfloat16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(gguf, *more):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "256", "--type_k", "0", "--type_v", "0", *more],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/models", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    pytest.fail("llama-cpp-python's server did not start")


def test_llama_cpp_python_server_through_openai(tiny, tmp_path):
    """llama-cpp-python's server takes text prompts only (--prompt-as text: the prompt's tokens are
    checked through echo) and returns token texts; plain and with prompt lookup, F32 KV cache."""
    pytest.importorskip("uvicorn")
    d, prompts = tiny
    gguf = export(d, tmp_path / "m.gguf")
    greedy, greedy_url = serve(gguf)
    try:
        spec, spec_url = serve(gguf, "--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "10")
        try:
            code, out, err = call(compare.main, "--engine", "openai", "--url", spec_url, "--greedy-url", greedy_url,
                                  "--weights", d, "--prompts", prompts, "--max-new-tokens", 12, "--prompt-as", "text",
                                  "--json")
        finally:
            spec.kill()
    finally:
        greedy.kill()
    assert code == 0, out + err
    runs = json.loads(out.splitlines()[-1])["runs"]
    assert [r["against"] for r in runs] == ["reference", "reference", "greedy"]
    assert all(r["summary"]["divergence"] == 0 and r["summary"]["empty"] == 0 for r in runs), out
