"""--engine llama.cpp through llama-cpp-python (skipped where it is not installed; CI does not build
it): on a tiny F32 model exported here, every setting and KV cache type is judged with the
calibration the run measures, which a second run reuses from its file; llama-cpp-python's own
server is checked through --engine openai, and on SmolLM2's GGUF (where fetched) started correctly and with a wrong
--rope_freq_base: a pass and a divergence by the whole-output test. Without the package: one line naming the
install."""
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
    assert all(r["whole"]["verdict"] == "pass" and r["whole"]["noise"]["source"].startswith("calibrated: ")
               for r in runs if r.get("against") == "reference")  # judged whole against its own measured noise
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


def serve(gguf, *more, n_ctx: int = 256):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", str(n_ctx), "--type_k", "0", "--type_v", "0", *more],
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


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2's Q4_1 GGUF and its converted directory, where `python -m nanospec.io.fetch smollm2` put them,
    with a reference trace of two of its prompts (16 tokens each), traced once for both servers."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("uvicorn")
    from pathlib import Path

    from nanospec.io.checkpoint import load
    from nanospec.io.files import cache_root
    from nanospec.io.sources import MODELS, converted
    from nanospec.io.tokenizer import load_tokenizer
    from nanospec.oracle import trace
    from nanospec.oracle.engines import prompt_texts, reference
    gguf, hf = cache_root() / "downloads" / Path(MODELS["smollm2"][1]).name, converted("smollm2")
    if not gguf.is_file() or not (hf / "config.json").is_file():
        pytest.skip("SmolLM2 is not fetched here (python -m nanospec.io.fetch smollm2)")
    tok = load_tokenizer(hf)

    class Args:
        prompts, limit = None, 2
    root = Path(__file__).resolve().parents[1] / "weights" / "smollm2"
    prompts = [tok.encode(t) for t in prompt_texts(Args, root)]
    ref = tmp_path_factory.mktemp("smollm2") / "ref.jsonl"
    trace.write(ref, reference(load(hf), prompts, 16))
    return gguf, root, ref


@pytest.mark.parametrize("more, verdict", [((), "pass"), (("--rope_freq_base", "10000"), "divergence")])
def test_a_real_server_with_a_wrong_rope_base_is_a_divergence(smollm2, more, verdict):
    """llama-cpp-python's server on SmolLM2's Q4_1 GGUF, uncalibrated, judged against nanospec's bf16 noise
    (--dtype bfloat16, as a quantized server must be without a calibration), with the rows it lists: correct, it
    passes; started with --rope_freq_base 10000 (the checkpoint's is 100000), it is a divergence, exit 1."""
    gguf, root, ref = smollm2
    proc, url = serve(gguf, *more, n_ctx=1024)
    try:
        code, out, err = call(compare.main, ref, "--engine", "openai", "--url", url, "--weights", root, "--limit", 2,
                              "--max-new-tokens", 16, "--prompt-as", "text", "--dtype", "bfloat16", "--no-floors",
                              "--json")
    finally:
        proc.kill()
    assert code == (0 if verdict == "pass" else 1), out + err
    (run,) = json.loads(out.splitlines()[-1])["runs"]
    assert run["whole"]["verdict"] == verdict and run["whole"]["positions"] == 32, out
    assert "whole output: 32 positions scored by nanospec fp32" in out
    assert run["whole"]["distance"] is not None, out  # the server was asked for its rows (logprobs), and gave them
