"""The oracle for other engines: decode.py --trace, nanospec.oracle.compare's verdicts, and transformers as a client."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import decode
from helpers import call, random_model
from nanospec import NanospecError
from nanospec.engine import generate
from nanospec.io.checkpoint import save
from nanospec.model import ModelArgs
from nanospec.oracle import compare, trace

ROOT = Path(__file__).resolve().parents[1]
ARGS = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, intermediate_size=40)


def run(module_or_script, *args):
    target = [module_or_script] if module_or_script.endswith(".py") else ["-m", module_or_script]
    cmd = [sys.executable, *target, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_trace_entry_describes_the_rows():
    model = random_model(ARGS, seed=1)
    prompt = [5, 9, 2, 33]
    out = generate(model, prompt, max_new_tokens=10, exact=True, record_logits=True, eos_id=-1)
    e = trace.record(prompt, out.tokens, out.logits, k=5, method="ar")
    assert e["format"] == "nanospec-trace/1" and e["prompt_ids"] == prompt and e["output_ids"] == out.tokens
    for tok, pos, row in zip(out.tokens, e["positions"], out.logits):
        assert pos["top_ids"][0] == tok == int(row.argmax()) and len(pos["top_ids"]) == 5
        assert pos["top_logits"] == sorted(pos["top_logits"], reverse=True)
        assert pos["top_logits"][0] == float(row.max())  # fp32 values survive JSON exactly
        assert abs(pos["lse"] - float(torch.logsumexp(row.double(), -1))) < 1e-9
        assert pos["sha256"] == hashlib.sha256(row.numpy().tobytes()).hexdigest()


def positions(*rows):
    return [{"top_ids": ids, "top_logits": vals, "lse": 0.0, "sha256": f"{i}"} for i, (ids, vals) in enumerate(rows)]


REF = {"format": trace.FORMAT, "dtype": "float32", "prompt_ids": [1, 2], "output_ids": [5, 6],
       "positions": positions(([5, 7, 9], [1.0, 0.5, -3.0]), ([6, 8, 4], [10.0, 9.99, 3.0]))}


@pytest.mark.parametrize("other, dtype, verdict", [
    ([5, 6], None, "identical"),
    ([5, 6, 7], None, "identical"),    # longer: compared where both have tokens
    ([5], None, "short"),              # stops early without an EOS
    ([], None, "empty"),
    ([5, 8], "bfloat16", "near-tie"),  # gap 0.01 <= 8 * 2^-7 * 10
    ([5, 8], "float32", "divergence"),  # gap 0.01 > 32 * 2^-23 * 10
    ([7, 6], "bfloat16", "divergence"),  # gap 0.5 > 8 * 2^-7 * 1
    ([5, 4], "bfloat16", "divergence"),  # far below the top
    ([5, 11], "bfloat16", "divergence"),  # not in the reference's top-k
])
def test_verdicts(other, dtype, verdict):
    (r,) = compare.compare([REF], [{"prompt_ids": [1, 2], "output_ids": other}], dtype)
    assert r["verdict"] == verdict
    if verdict in ("near-tie", "divergence"):
        i = r["position"]
        assert REF["output_ids"][i] == r["reference_token"] and other[i] == r["other_token"] != r["reference_token"]
        top = REF["positions"][i]["top_logits"]
        assert r["margin"] == top[0] - top[1]
        assert r["tolerance"] == (compare.ULPS[r["dtype"]] * compare.EPS[r["dtype"]]
                                  * max(1.0, abs(top[0]), abs(top[-1])))


def test_tolerance_follows_the_coarser_dtype_and_the_scale():
    pos = REF["positions"][1]
    assert compare.tolerance(pos, "bfloat16") == 8 * 2**-7 * 10
    assert compare.tolerance(REF["positions"][0], "bfloat16") == 8 * 2**-7 * 3  # |-3| is the row's largest
    assert compare.coarser("float32", "bfloat16") == "bfloat16" == compare.coarser("bfloat16", None)
    with pytest.raises(NanospecError, match="unknown dtype"):
        compare.coarser("float8")


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(NanospecError, match="does not trace"):
        compare.compare([REF], [{"prompt_ids": [3], "output_ids": [5]}])
    with pytest.raises(NanospecError, match="sampled"):
        compare.compare([{**REF, "temperature": 1.0}], [{"prompt_ids": [1, 2], "output_ids": [5]}])
    with pytest.raises(NanospecError, match="different weights"):
        compare.compare([{**REF, "model": "a"}], [{"prompt_ids": [1, 2], "output_ids": [5], "model": "b"}])


def test_cli_exit_codes_and_json(tmp_path):
    ref, ok, bad = tmp_path / "ref.jsonl", tmp_path / "ok.jsonl", tmp_path / "bad.jsonl"
    trace.write(ref, [REF])
    ok.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": [5, 8], "dtype": "bfloat16"}) + "\n")
    bad.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": [7, 6]}) + "\n")
    code, out, err = call(compare.main, ref, ok, "--json")
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])["runs"][0]["summary"]
    assert summary == {"prompts": 1, "identical": 0, "near-tie": 1, "divergence": 0, "short": 0, "empty": 0,
                       "not-bitwise": 0}
    assert "1 near-tie, 0 divergence" in out
    res = run("nanospec.oracle.compare", ref, bad)  # the module's own command line, once
    assert res.returncode == 1 and "divergence" in res.stdout
    for args, msg in [((ref, tmp_path / "none.jsonl"), "no trace at"), ((ok, ok), "not a nanospec-trace/1 line"),
                      ((ref,), "give REFERENCE.jsonl and OTHER.jsonl"), ((ref, ok, "--ulps", "x"), "invalid float"),
                      (("--engine", "transformers", "--bitwise"), "--bitwise compares two full traces"),
                      (("--engine", "openai", "--batch", "2"), "--batch runs with --engine transformers"),
                      (("--engine", "transformers", "--concurrency", "0"), "must be at least 1")]:
        code, _, err = call(compare.main, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and msg in err, err


def test_decode_trace_of_a_method_is_bitwise_the_reference(weights, tmp_path):
    """--trace from decode.py: Lookahead's exact-mode trace is AR's, row by row (sha256), and compare says so."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):", "import os\n"]))
    common = ["--weights", weights, "--prompts", prompts, "--max-new-tokens", 16, "--mode", "exact"]
    for method in ["ar", "lookahead"]:
        code, _, err = call(decode.main, *common, "--method", method, "--trace", tmp_path / f"{method}.jsonl")
        assert code == 0, err
    ref, la = trace.read(tmp_path / "ar.jsonl", full=True), trace.read(tmp_path / "lookahead.jsonl", full=True)
    assert [e["positions"] for e in ref] == [e["positions"] for e in la] and len(ref) == 2
    assert ref[0]["method"] == "ar" and ref[0]["mode"] == "exact" and ref[0]["dtype"] == "float32"
    code, out, err = call(compare.main, tmp_path / "ar.jsonl", tmp_path / "lookahead.jsonl", "--json", "--bitwise")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["runs"][0]["summary"]["bitwise"] == 2
    assert "2 identical (2 bitwise)" in out


def test_transformers_client(weights, tmp_path):
    """transformers' own generate (greedy, prompt lookup, assisted with a second small model) on the
    same weights: compared with nanospec's exact AR, and its speculative settings with its own
    greedy output (self-consistency), nothing is a divergence."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):\n    return", "class A:"]))
    assistant = tmp_path / "assistant"
    save(random_model(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=400, intermediate_size=24), seed=7),
         assistant)
    code, out, err = call(compare.main, "--engine", "transformers", "--weights", weights, "--prompts", prompts,
                          "--max-new-tokens", 12, "--dtype", "float32,bfloat16", "--assistant", assistant, "--json",
                          "--save", tmp_path / "traces")
    assert code == 0, out + err
    runs = json.loads(out.splitlines()[-1])["runs"]
    assert [(r["setting"], r["dtype"], r["against"]) for r in runs] == [
        (s, d, a) for d in ("float32", "bfloat16") for s, a in (("greedy", "reference"), ("prompt_lookup", "reference"),
                                                                ("prompt_lookup", "greedy"), ("assisted", "reference"),
                                                                ("assisted", "greedy"))]
    assert all(r["summary"]["prompts"] == 2 and r["summary"]["divergence"] == 0 for r in runs)
    assert all(r["whole"]["verdict"] == "pass" for r in runs if r["against"] == "reference")
    assert all(r["whole"]["verdict"] == "pass" and r["whole"]["noise"]["source"] == "the engine's own plain run"
               for r in runs if r["against"] == "greedy")  # judged whole against its own greedy run
    assert "transformers prompt_lookup float32 cpu vs its own greedy: 2 prompts" in out
    assert "nanospec bfloat16 vs float32, measured now" in out and "detection floor (" in out
    saved = trace.read(tmp_path / "traces" / "transformers-greedy-float32.jsonl")
    assert len(saved) == 2 and all(0 < len(e["output_ids"]) <= 12 for e in saved)
    assert all(len(e["positions"]) == len(e["output_ids"]) for e in saved)  # its own rows, top-k


def test_transformers_self_consistency_alone(weights, tmp_path):
    """--self-only: no nanospec reference, only prompt lookup against transformers' own greedy output."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    code, out, err = call(compare.main, "--engine", "transformers", "--weights", weights, "--prompts", prompts,
                          "--max-new-tokens", 8, "--dtype", "float32", "--settings", "greedy,prompt_lookup",
                          "--self-only", "--json")
    assert code == 0 and "nanospec ar exact" not in err, err
    (run,) = json.loads(out.splitlines()[-1])["runs"]
    assert (run["setting"], run["against"], run["summary"]["identical"]) == ("prompt_lookup", "greedy", 1)


def test_transformers_batch_question(weights, tmp_path, monkeypatch):
    """--batch 2: prompts of unequal lengths decoded two at a time, left-padded, judged against the
    reference and against each prompt alone; with the pads planted as attended (no attention mask),
    the batched output is caught against both."""
    pytest.importorskip("transformers")
    from nanospec.oracle.engines import hf
    prompts = tmp_path / "p.jsonl"
    texts = ["def f(x):\n    return", "import os\n", "class Stack:\n    def push(self, x):", "for i in"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ["--engine", "transformers", "--weights", weights, "--prompts", prompts, "--max-new-tokens", 12,
              "--settings", "greedy", "--batch", 2, "--json"]
    code, out, err = call(compare.main, *common, "--dtype", "float32,bfloat16")
    assert code == 0, out + err
    runs = json.loads(out.splitlines()[-1])["runs"]
    assert [(r["setting"], r["dtype"], r["against"]) for r in runs] == [
        (s, d, a) for d in ("float32", "bfloat16")
        for s, a in (("greedy", "reference"), ("greedy batch 2", "reference"), ("greedy batch 2", "alone"))]
    assert all(r["summary"]["prompts"] == 4 and r["summary"]["divergence"] == 0 for r in runs)
    assert "transformers greedy batch 2 float32 cpu vs each prompt alone: 4 prompts" in out
    padded = hf.left_padded

    def attended(seqs, pad, device):  # the planted fault: the pads are attended
        ids, mask = padded(seqs, pad, device)
        return ids, torch.ones_like(mask)
    monkeypatch.setattr(hf, "left_padded", attended)
    code, out, err = call(compare.main, *common, "--dtype", "float32")
    runs = {r["against"]: r for r in json.loads(out.splitlines()[-1])["runs"] if r["setting"] == "greedy batch 2"}
    assert code == 1 and all(r["summary"]["divergence"] > 0 for r in runs.values()), out + err


def test_calibration_stays_inside_the_tolerance(weights, tmp_path):
    """The near-tie tolerance covers how far transformers' forward moves nanospec's top-2 gaps, alone
    and in a left-padded batch of 2."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):", "import os, sys\n"]))
    code, out, err = call(compare.main, "--engine", "transformers", "--calibrate", "--weights", weights,
                          "--prompts", prompts, "--max-new-tokens", 16, "--dtype", "float32,bfloat16", "--json",
                          "--batch", 2)
    assert code == 0, err
    runs = json.loads(out.splitlines()[-1])["runs"]
    assert [(r["dtype"], r["reference_dtype"], r["batch"]) for r in runs] == [
        ("float32", "float32", 1), ("float32", "float32", 2), ("bfloat16", "bfloat16", 1), ("bfloat16", "bfloat16", 2),
        ("bfloat16", "float32", 1)]
    assert all(16 < r["positions"] <= 32 and 0 <= r["max"] < compare.ULPS[r["units"]] for r in runs)
    assert "calibration: transformers float32 batch 2 vs nanospec exact AR float32" in out


def test_two_files_with_weights_get_the_whole_output_verdict(weights, tmp_path):
    """REFERENCE OTHER --weights: nanospec fp32 forces OTHER's tokens and the whole-output test judges them
    against fp32 noise measured now: AR's own trace passes, an engine with RoPE's base /10 is a divergence."""
    from nanospec.io.checkpoint import load
    from nanospec.oracle import plants
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):", "import os\n", "class A:"]))
    code, _, err = call(decode.main, "--weights", weights, "--prompts", prompts, "--max-new-tokens", 24, "--mode",
                        "exact", "--trace", tmp_path / "ar.jsonl")
    assert code == 0, err
    refs, model = trace.read(tmp_path / "ar.jsonl", full=True), load(weights)
    planted = [{"prompt_ids": e["prompt_ids"], "output_ids": plants.decode(model, e["prompt_ids"], 24, "rope_base", 10)}
               for e in refs]
    (tmp_path / "bug.jsonl").write_text("".join(json.dumps(e) + "\n" for e in planted))
    code, out, err = call(compare.main, tmp_path / "ar.jsonl", tmp_path / "ar.jsonl", "--weights", weights, "--json")
    assert code == 0 and "whole output: 72 positions scored by nanospec fp32: 0 flips" in out, out + err
    assert json.loads(out.splitlines()[-1])["runs"][0]["whole"]["verdict"] == "pass"
    assert "detection floor (nanospec float32 vs float32, measured now), from ids: rope base /" in out
    code, out, err = call(compare.main, tmp_path / "ar.jsonl", tmp_path / "bug.jsonl", "--weights", weights, "--json",
                          "--no-floors")
    (run,) = json.loads(out.splitlines()[-1])["runs"]
    assert code == 1 and run["whole"]["verdict"] == "divergence" and run["whole"]["log10_p"] < -4, out + err
    assert "detection floor" not in out and "(4 x the smallest, Bonferroni; alpha 0.0001): divergence" in out
