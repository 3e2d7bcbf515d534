"""Every detector behind the word "identical" is shown to detect: planted faults (a changed token,
a one-ulp logit, a truncated or empty output, a wrong row hash) must make --check, the benchmark
and nanospec.oracle.compare fail, with the documented exit codes."""
import json

import pytest

import decode
from helpers import Corrupt, call, random_model
from nanospec.bench import bench, same_as_ar
from nanospec.engine import generate
from nanospec.methods import METHODS
from nanospec.model import ModelArgs
from nanospec.oracle import compare, trace

ARGS = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, intermediate_size=40)


@pytest.fixture
def corrupt(monkeypatch):
    """--method corrupt[:at=N,ulp=true] on the command line: AR with a planted fault."""
    monkeypatch.setitem(METHODS, "corrupt", Corrupt)


def test_same_as_ar_sees_a_changed_token_and_a_flipped_bit():
    model = random_model(ARGS, seed=2)
    kw = dict(max_new_tokens=10, eos_id=-1, exact=True, record_logits=True)
    ref = generate(model, [3, 4, 5], **kw)
    assert same_as_ar(generate(model, [3, 4, 5], **kw), ref, exact=True)
    wrong = generate(model, [3, 4, 5], Corrupt(at=4), **kw)
    assert wrong.tokens[:3] == ref.tokens[:3] and wrong.tokens[3] != ref.tokens[3]
    assert not same_as_ar(wrong, ref, exact=True) and not same_as_ar(wrong, ref, exact=False)
    ulp = generate(model, [3, 4, 5], Corrupt(at=4, ulp=True), **kw)
    assert ulp.tokens == ref.tokens  # the same tokens: only the bits tell
    assert same_as_ar(ulp, ref, exact=False) and not same_as_ar(ulp, ref, exact=True)


@pytest.mark.parametrize("mode, spec, found", [
    ("fast", "corrupt:at=2", "DIFFERENT: token 1:"),
    ("exact", "corrupt:at=2", "DIFFERENT: token 1:"),
    ("exact", "corrupt:at=5,ulp=true", "DIFFERENT: logits differ at token 4"),
])
def test_check_exits_1_on_a_planted_fault(weights, corrupt, mode, spec, found):
    code, _, err = call(decode.main, "--weights", weights, "--method", spec, "--mode", mode, "--check",
                        "--max-new-tokens", 8, "--prompt", "def f(x):")
    assert code == 1 and found in err, err
    code, _, err = call(decode.main, "--weights", weights, "--method", "ar", "--mode", mode, "--check",
                        "--max-new-tokens", 8, "--prompt", "def f(x):")
    assert code == 0 and "identical" in err


@pytest.mark.parametrize("exact, ulp", [(False, False), (True, False), (True, True)])
def test_bench_counts_mismatches(exact, ulp):
    model = random_model(ARGS, seed=5)
    prompts = [[1, 2, 3], [7, 8], [9]]
    res = bench(model, prompts, [Corrupt(at=2, ulp=ulp), Corrupt(at=100)], exact=exact, max_new_tokens=6, eos_id=-1)
    assert [r["mismatches"] for r in res] == [3, 0]  # at=100: never reached, so no fault


# --- nanospec.oracle.compare on a real trace, with planted faults ---------------------------------------

@pytest.fixture(scope="module")
def traced():
    """A reference trace of three prompts and the same outputs as another engine would send them."""
    model = random_model(ARGS, seed=7)
    ref = []
    for p in ([5, 9, 2], [4], [11, 12, 13, 14]):
        out = generate(model, p, max_new_tokens=8, exact=True, record_logits=True, eos_id=-1)
        ref.append(trace.record(p, out.tokens, out.logits, k=8, method="ar", mode="exact", dtype="float32",
                                eos_id=-1, temperature=0.0))
    return ref


def run_compare(tmp_path, ref, other, *flags):
    trace.write(tmp_path / "ref.jsonl", ref)
    trace.write(tmp_path / "other.jsonl", other)
    code, out, err = call(compare.main, tmp_path / "ref.jsonl", tmp_path / "other.jsonl", "--json", *flags)
    return code, json.loads(out.splitlines()[-1])["runs"][0] if code in (0, 1) else None, out + err


def ids_only(ref, edit=lambda i, ids: ids):
    return [{"prompt_ids": e["prompt_ids"], "output_ids": edit(i, list(e["output_ids"]))} for i, e in enumerate(ref)]


def test_compare_passes_the_reference_itself(traced, tmp_path):
    code, run, _ = run_compare(tmp_path, traced, traced, "--bitwise")
    assert code == 0 and run["summary"]["identical"] == 3 and run["summary"]["bitwise"] == 3
    code, run, _ = run_compare(tmp_path, traced, ids_only(traced))
    assert code == 0 and run["summary"]["identical"] == 3


def test_compare_fails_a_changed_token(traced, tmp_path):
    def change(i, ids):
        if i == 1:
            ids[5] = traced[1]["positions"][5]["top_ids"][-1]  # the 8th-ranked token: far from a tie
        return ids
    code, run, text = run_compare(tmp_path, traced, ids_only(traced, change))
    (r,) = [r for r in run["results"] if r["verdict"] != "identical"]
    assert code == 1 and r["prompt"] == 1 and r["position"] == 5 and r["verdict"] == "divergence", text


def test_compare_fails_a_truncated_output(traced, tmp_path):
    cut = ids_only(traced, lambda i, ids: ids[:3] if i == 2 else ids)
    code, run, text = run_compare(tmp_path, traced, cut)
    (r,) = [r for r in run["results"] if r["verdict"] != "identical"]
    assert code == 1 and r["verdict"] == "short" and r["position"] == 3
    assert r["reference_next"] == traced[2]["output_ids"][3] and "short: stops at position 3" in text
    code, run, _ = run_compare(tmp_path, traced, cut, "--allow-short")
    assert code == 0 and run["summary"]["short"] == 1


def test_compare_fails_an_empty_output_even_when_short_is_allowed(traced, tmp_path):
    code, run, _ = run_compare(tmp_path, traced, ids_only(traced, lambda i, ids: []), "--allow-short")
    assert code == 1 and run["summary"]["empty"] == 3


def test_compare_stops_at_eos_are_not_short(traced, tmp_path):
    eos = traced[0]["output_ids"][4]
    other = ids_only(traced, lambda i, ids: ids[:5] if i == 0 else ids)
    other[0]["eos_id"] = eos  # the other engine stopped at its EOS there
    code, run, _ = run_compare(tmp_path, traced, other)
    assert code == 0 and run["summary"]["identical"] == 3


def test_compare_bitwise_fails_a_wrong_row_hash(traced, tmp_path):
    other = json.loads(json.dumps(traced))
    other[2]["positions"][6]["sha256"] = "0" * 64
    other[2]["positions"][6]["top_logits"][0] += 0.25
    code, run, text = run_compare(tmp_path, traced, other)
    assert code == 0 and run["summary"]["bitwise"] == 2  # ids identical: bitwise is reported, not required
    code, run, text = run_compare(tmp_path, traced, other, "--bitwise")
    (r,) = [r for r in run["results"] if r["verdict"] != "identical"]
    assert code == 1 and r["verdict"] == "not-bitwise" and r["prompt"] == 2 and r["position"] == 6
    assert r["max_abs_diff"] == 0.25 and "first row whose sha256 differs" in text
    code, _, text = run_compare(tmp_path, traced, ids_only(traced), "--bitwise")
    assert code == 2 and "--bitwise needs a full trace" in text


def test_decode_trace_with_a_planted_ulp_fails_bitwise_compare(weights, corrupt, tmp_path):
    """End to end: an exact-mode trace whose one row is one ulp off: ids identical, --bitwise fails."""
    common = ["--weights", weights, "--prompt", "def f(x):", "--max-new-tokens", 8, "--mode", "exact"]
    assert call(decode.main, *common, "--trace", tmp_path / "ar.jsonl")[0] == 0
    assert call(decode.main, *common, "--method", "corrupt:at=3,ulp=true", "--trace", tmp_path / "bad.jsonl")[0] == 0
    code, out, _ = call(compare.main, tmp_path / "ar.jsonl", tmp_path / "bad.jsonl", "--bitwise")
    assert code == 1 and "1 not-bitwise" in out and "position 2 is the first row" in out
