"""decode.py end to end: JSON output, --check, --bench, and one-line errors (exit code 2) for bad input."""
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import decode
from helpers import call, random_model, run_cli
from nanospec import NanospecError
from nanospec.io.checkpoint import save
from nanospec.methods import METHODS, model_dir, split_specs
from nanospec.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]
PYLM = ROOT / "weights" / "pylm"


def last_json(res):
    code, out, err = res
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_check_json(weights, mode):
    out = last_json(call(decode.main, "--weights", weights, "--prompt", "def f(x):", "--max-new-tokens", 12,
                         "--mode", mode, "--check", "--json"))
    keys = {"method", "mode", "device", "dtype", "prompt", "text", "token_ids", "new_tokens", "steps",
            "mean_accepted", "tokens_per_s", "seconds", "identical_to_ar"}
    assert keys <= out.keys()
    assert out["identical_to_ar"] is True and out["mode"] == mode and out["method"] == "ar"
    assert 0 < out["new_tokens"] == len(out["token_ids"]) <= 12 and out["steps"] == out["new_tokens"]


def test_check_compares_warm_speeds(weights, monkeypatch):
    """--check runs the method (a copy of its drafter) and AR once each, short and untimed, before the runs it times
    and compares: its speed ratio is between warm runs, and says that --bench is the measurement. The JSON is as
    without the warm-up."""
    calls, real = [], decode.generate

    def spy(model, prompt, drafter=None, **kw):
        calls.append((drafter, kw["max_new_tokens"]))
        return real(model, prompt, drafter, **kw)
    monkeypatch.setattr(decode, "generate", spy)
    code, out, err = call(decode.main, "--weights", weights, "--prompt", "def f(x):", "--max-new-tokens", 12,
                          "--method", "lookahead", "--mode", "exact", "--check", "--json")
    assert code == 0, err
    (warm_d, n_warm_d), (warm_ar, n_warm_ar), (d, n_d), (ar, n_ar) = calls
    assert warm_ar is ar is decode.AR and type(warm_d) is type(d) and warm_d is not d
    assert n_warm_d == n_warm_ar == 8 and n_d == n_ar == 12
    assert "x (warm, one run; --bench measures)" in err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["identical_to_ar"] is True and res["method"] == "lookahead" and 0 < res["new_tokens"] <= 12


def test_sampling_and_no_check(weights):
    args = ("--weights", weights, "--max-new-tokens", 8, "--temperature", 1.0, "--top-p", 0.9, "--seed", 4, "--json")
    a, b = last_json(call(decode.main, *args)), last_json(call(decode.main, *args))
    assert a["identical_to_ar"] is None and a["token_ids"] == b["token_ids"]


def test_checkpoint_written_by_transformers(tmp_path, weights):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=40)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes((weights / "tokenizer.model").read_bytes())
    out = last_json(call(decode.main, "--method", "ar", "--weights", tmp_path, "--check", "--json", "--mode", "exact",
                         "--max-new-tokens", 6))
    assert out["identical_to_ar"] is True


def test_bench_json(weights, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]) + "\n")
    out = last_json(call(decode.main, "--weights", weights, "--bench", "--prompts", prompts, "--methods", "ar",
                         "--max-new-tokens", 8, "--json"))
    assert {"device", "dtype", "mode", "results"} <= out.keys()
    (r,) = out["results"]
    assert r["method"] == "ar" and r["prompts"] == 2 and r["mismatches"] == 0 and r["speedup"] > 0
    assert {"new_tokens", "steps", "mean_accepted", "forward_ms", "tokens_per_s"} <= r.keys() and r["forward_ms"] > 0


def test_the_ar_row_joins_its_modes_ar_in_the_baseline():
    """The AR row decodes as its mode's AR: the baseline is one speed over both's timings, not the faster of the two
    (a maximum of two noisy reads of one speed reads high). A kind the bench ran no twin of stands alone."""
    from nanospec.bench import Drafter, Output, ar_speeds
    timed = lambda n, s: Output([0] * n, "max_new_tokens", decode_s=s)
    base, outs = {"fast AR": [timed(10, 1.0)]}, [[timed(10, 0.5)], [timed(10, 0.1)]]
    drafters = [Drafter(), object()]  # the AR row, then a method
    tps, name, runs = ar_speeds(base, drafters, outs, exact=False)
    assert (round(tps, 3), name, len(runs)) == (13.333, "fast AR", 2)  # 20 tokens in 1.5 s, not 20 tok/s
    assert base["fast AR"] == [timed(10, 1.0)]  # the bench's own lists are left as they were
    tps, name, _ = ar_speeds(base, drafters, outs, exact=True)  # a batch's exact AR row: no exact AR beside it
    assert (tps, name) == (20.0, "AR row")


def test_alone_each_prompts_round_runs_in_order_then_in_reverse(monkeypatch):
    """At B = 1 every prompt runs under AR and each method in turn, the round reversed on the next prompt, so a drift
    in the machine's speed over a round hits every method alike (AR first on one prompt, last on the next)."""
    from helpers import ARGS, drafter
    from nanospec import bench
    model, timed, real = random_model(ARGS, 1), [], bench.generate
    monkeypatch.setattr(bench, "generate", lambda model, prompt, d, **kw: (
        timed.append(d.name) if kw["max_new_tokens"] == 12 else None) or real(model, prompt, d, **kw))
    bench.bench(model, [[3, 4, 5], [6, 7], [8, 9, 10]], [drafter("medusa", model)], max_new_tokens=12, eos_id=-1)
    assert timed[:6] == ["ar", "medusa", "medusa", "ar", "ar", "medusa"]


def test_a_batchs_method_runs_between_two_ar_passes_and_is_measured_against_them(monkeypatch):
    """At B > 1 each method's pass runs between two of AR's, all twice, the second time in reverse, and its speedup
    is against those AR passes. Planted pass times (the third to the fifth pass, AR, SDSAT, AR, take 2 s, the others
    1 s; 36 tokens a pass): Medusa's 72 tokens in 2 s against 144 in 5 s, 1.25x; SDSAT's 72 in 3 s against 144 in
    7 s, 1.167x (against all five AR passes, 180 tokens in 7 s: 1.4x and 0.933x)."""
    from helpers import ARGS, drafter
    from nanospec import bench
    model, timed, real, batched = random_model(ARGS, 1), [], bench.generate, bench.batched
    monkeypatch.setattr(bench, "generate", lambda model, prompt, d, **kw: (
        timed.append(d.name) if kw["batch"] == 2 else None) or real(model, prompt, d, **kw))
    monkeypatch.setattr(bench, "batched", lambda outs, s: batched(outs, 1.0 + (2 <= len(timed) - 1 <= 4)))
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10]]
    res = bench.bench(model, prompts, [drafter("medusa", model), drafter("sdsat", model)], max_new_tokens=12,
                      eos_id=-1, batch=2)
    assert timed == ["ar", "medusa", "ar", "sdsat", "ar", "sdsat", "ar", "medusa", "ar"]
    assert [(r["new_tokens"], r["speedup"], r["baseline"]) for r in res] == [(72, 1.25, "fast AR beside it"),
                                                                             (72, 1.167, "fast AR beside it")]


def test_a_profile_runs_each_drafter_as_the_timed_runs_found_it(monkeypatch):
    """--profile's run starts from the drafter as it was before the timed runs: Lookahead's trie holds no output
    yet (profiled after them, its trie would hold every output, and it would draft better than the bench did)."""
    from helpers import ARGS
    from nanospec import bench
    from nanospec.methods.lookahead import Lookahead
    model, profiled, timed, real = random_model(ARGS, 1), [], [], bench.generate
    outputs = lambda d: sum(d.trie.sizes.values())  # the trie's nodes that outputs put there
    monkeypatch.setattr(bench, "host_profile", lambda run, d, prompts, base: profiled.append(outputs(d)) or "")
    monkeypatch.setattr(bench, "generate", lambda model, prompt, d, **kw: (
        timed.append(outputs(d)) if kw["max_new_tokens"] == 12 and d.name == "lookahead" else None) or
        real(model, prompt, d, **kw))
    la = Lookahead(decoding_length=8, branch_length=4)
    bench.bench(model, [[3, 4, 5], [6, 7], [8, 9, 10]], [la], max_new_tokens=12, eos_id=-1, profile=True)
    assert outputs(la) > 0 and profiled == [timed[0]] == [0]  # the timed runs filled its trie; not the profile's


def test_an_ar_step_is_compared_with_ars_over_as_many_sequences():
    """A batch's tail step (one sequence left) costs about a full batch's step: a method whose AR steps fall there
    is compared with AR's tail steps, not with AR's full-batch share; a stall on one of its steps is not its cost."""
    from nanospec.bench import Output, ar_step_vs
    ar = Output([], "", ar_steps=[(4, 0.04)] * 12 + [(1, 0.04)] * 2)
    assert ar_step_vs([Output([], "", ar_steps=[(1, 0.04)] * 2)], [ar]) == 1.0
    assert ar_step_vs([Output([], "", ar_steps=[(4, 0.044)] * 4)], [ar]) == 1.1
    assert ar_step_vs([Output([], "", ar_steps=[(4, 0.04)] * 9 + [(4, 0.4)])], [ar]) == 1.0  # a stall: not the method


def test_bench_with_drafters_reads_the_weights_prompts(weights, tmp_path):
    """--bench --drafters DIR, where DIR holds drafters only, benches the --weights directory's prompts.jsonl."""
    own = shutil.copytree(weights, tmp_path / "w")
    (own / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]))
    (tmp_path / "d").mkdir()
    (r,) = last_json(call(decode.main, "--weights", own, "--drafters", tmp_path / "d", "--bench", "--methods", "ar",
                          "--max-new-tokens", 4, "--json"))["results"]
    assert r["prompts"] == 2 and r["mismatches"] == 0


def test_prompts_decode_in_batches_and_bench_by_batch_size(weights, tmp_path):
    """--batch 2 decodes the prompts two at a time (a stopped one's row takes the next), each as alone (--check: AR
    alone, bitwise in exact mode); --bench --batch 1,2 reports each size against AR at that size (a batch size's runs
    twice, in order and in reverse)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n", "class A:"]) + "\n")
    code, out, err = call(decode.main, "--weights", weights, "--prompts", prompts, "--batch", 2, "--method",
                          "lookahead", "--mode", "exact", "--max-new-tokens", 10, "--check", "--json")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and len(rows) == 3 and all(r["identical_to_ar"] for r in rows), err
    assert "3 prompts, 2 at a time" in err
    res = last_json(call(decode.main, "--weights", weights, "--bench", "--prompts", prompts, "--methods",
                         "ar,lookahead", "--max-new-tokens", 8, "--batch", "1,2", "--json"))["results"]
    assert [(r["method"], r["batch"]) for r in res] == [("ar", 1), ("lookahead", 1), ("ar", 2), ("lookahead", 2)]
    assert all(r["mismatches"] == 0 and r["speedup"] > 0 for r in res)
    assert [r["new_tokens"] for r in res[2:]] == [2 * r["new_tokens"] for r in res[:2]]  # batches run twice, ABBA


def test_a_fixed_budget_drafts_that_many_nodes_every_step():
    """--budget N: every method that can be planned (ranked, nested; ProPD's own planner replaced) drafts N nodes at
    every step (--show prints each step's budget), and 0 makes every step an AR step; tokens stay AR's."""
    for method in ("propd", "bita", "lookahead"):
        for n in (0, 2):
            code, out, err = call(decode.main, "--weights", PYLM, "--method", method, "--prompt", "def f(x):",
                                  "--max-new-tokens", 8, "--budget", n, "--kernels", "eager", "--show", "--check")
            budgets = re.findall(r"step \d+: .*, budget (\d+)[ ,]", err)
            assert code == 0 and "identical" in out + err and budgets and set(budgets) == {str(n)}, (method, n, err)


def test_methods_all_is_every_method_on_the_base_model():
    """--methods all: the registry's methods, in its order, but those that decode a fine-tuned model of their own
    (model_dir: another directory than the weights given), which a run beside the others cannot share."""
    names = split_specs("all")
    assert names == [n for n in METHODS if n in names] and "ar" in names
    for n in METHODS:
        try:
            own = model_dir([n], PYLM) != PYLM
        except NanospecError:  # its own model is not there
            own = True
        assert (n in names) != own, n


def test_bench_times_the_peers_in_the_same_run(weights, tmp_path):
    """--peers transformers: transformers' greedy, prompt lookup and assisted generation beside the
    methods, judged the same way (tok/s, tokens per step, speedup against the run's fastest AR, mismatches). A
    step is a forward of the model: greedy's make a token each."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]) + "\n")
    out = last_json(call(decode.main, "--weights", weights, "--bench", "--prompts", prompts, "--methods",
                         "ar,lookahead", "--max-new-tokens", 8, "--peers", "transformers", "--json"))
    rows = {r["method"]: r for r in out["results"]}
    assert list(rows) == ["ar", "lookahead", "transformers greedy", "transformers prompt_lookup",
                          "transformers assisted"]
    for name in ("transformers greedy", "transformers prompt_lookup", "transformers assisted"):
        r = rows[name]
        assert r["prompts"] == 2 and 0 < r["new_tokens"] <= 16 and r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["mismatches"] == 0 and r["baseline"] == rows["ar"]["baseline"]
        assert 0 < r["steps"] <= r["new_tokens"]
    assert rows["transformers greedy"]["steps"] == rows["transformers greedy"]["new_tokens"]


def test_prompts_file_decodes_each_with_one_drafter(weights, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n", "x = 1"]) + "\n")
    code, out, err = call(decode.main, "--weights", weights, "--prompts", prompts, "--limit", 2, "--max-new-tokens", 6,
                          "--json", "--method", "lookahead:strategy=parallel,decoding_length=4", "--check",
                          "--mode", "exact")
    assert code == 0, err
    outs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in outs] == ["def f(x):", "import os\n"]
    assert all(o["identical_to_ar"] is True for o in outs)


def test_the_script_itself_reports_bad_input_in_one_line(weights):
    """The command line as a user runs it (a subprocess): no traceback, one line, exit code 2."""
    res = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--weights", str(weights), "--method", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: unknown method 'nope'; choose from: {', '.join(METHODS)}"]


# --- bad input: one `error:` line on stderr, exit code 2, for each case ---------------------------------

@pytest.fixture
def bad_prompts(tmp_path):
    (tmp_path / "not-json.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    (tmp_path / "no-field.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--bench", "--methods", "ar,nope"], "unknown method 'nope'"),
    (["--method", "lookahead:depth"], "is not key=value"),
    (["--weights", "/nonexistent/dir"], "no weights directory"),
    (["--prompt-ids", "1,2,99999"], "out of range"),
    (["--prompt-ids=-1,2"], "token id -1 is out of range"),
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt", "def " * 50, "--max-len", 20], "shorten it or raise --max-len"),
    (["--prompt-file", "/nonexistent.txt"], "cannot read the prompt file"),
    (["--prompt-file", "{tmp}/latin1.txt"], "cannot read the prompt file"),
    (["--bench"], "--bench needs --prompts"),
    (["--bench", "--prompts", "/nonexistent.jsonl"], "no prompt file"),
    (["--bench", "--prompts", "{tmp}/not-json.jsonl"], "not-json.jsonl:2 is not a JSON object"),
    (["--prompts", "{tmp}/no-field.jsonl"], "no-field.jsonl:1 is not a JSON object with a \"prompt\" field"),
    (["--prompts", "{tmp}/blank.jsonl"], "holds no prompts"),
    (["--trace", "/nonexistent/dir/t.jsonl"], "its directory does not exist"),
    (["--bench", "--trace", "t.jsonl"], "--trace records decoding, not --bench"),
    (["--trace", "t.jsonl", "--trace-k", 1], "--trace-k must be at least 2"),
    (["--mode", "exact", "--block", 8], "at least 16 rows"),
    (["--max-new-tokens", 0], "--max-new-tokens must be at least 1"),
    (["--top-p", "0"], "0 < --top-p <= 1"),
    (["--top-p", "1.5"], "0 < --top-p <= 1"),
    (["--temperature", "-1"], "--temperature >= 0"),
    (["--top-k", "-2"], "--top-k >= 0"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--batch", "0"], "--batch '0': give positive sizes"),
    (["--batch", "two"], "--batch 'two': give positive sizes"),
    (["--batch", "1,2"], "--batch takes one size when decoding"),
    (["--bench", "--batch", "2", "--peers", "transformers"], "use it with --batch 1"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--budget", "-1"], "--budget N plans N >= 0 draft nodes"),
    (["--budget", 1, "--planner", "none"], "not with --planner none"),
    (["--budget", 1, "--mode", "exact"], "exact mode runs each method's own tree"),
    (["--device", "cuda"], "no CUDA device") if not torch.cuda.is_available()
    else (["--device", "tpu"], "invalid choice"),
])
def test_bad_input_gives_one_error_line(weights, bad_prompts, args, message):
    args = [str(a).replace("{tmp}", str(bad_prompts)) for a in args]
    assert message in run_cli(decode.main, *(["--weights", weights] if "--weights" not in args else []), *args)


@pytest.mark.parametrize("name", METHODS)
def test_an_unknown_method_option_is_one_error_line(weights, name):
    """Every registered method refuses an option its loader does not take, in one line that lists the ones it does
    (its loader's keyword arguments, or none)."""
    options = [p for p in inspect.signature(METHODS[name].load).parameters if p not in ("model", "weights")]
    line = run_cli(decode.main, "--weights", weights, "--method", f"{name}:no_such_option=3")
    assert line == f"error: {name} has no option 'no_such_option'; its options: {', '.join(options) or 'none'}"


@pytest.mark.parametrize("missing, message", [
    ("config.json", "has no config.json"),
    ("model.safetensors", "has no model.safetensors"),
    ("tokenizer.model", "has no tokenizer.json or tokenizer.model: pass --prompt-ids"),
])
def test_incomplete_weights_directory(weights, tmp_path, missing, message):
    d = tmp_path / "w"
    shutil.copytree(weights, d)
    (d / missing).unlink()
    assert message in run_cli(decode.main, "--weights", d, "--prompt", "def f(x):")


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{\"hidden_size\": 8")
    assert "not valid JSON" in run_cli(decode.main, "--weights", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert "lacks the key" in run_cli(decode.main, "--weights", tmp_path)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """The shipped drafters next to base weights they were not trained for (and an sdsat_full record
    of another model beside them)."""
    d = tmp_path_factory.mktemp("foreign") / "w"
    save(random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, intermediate_size=48)), d,
         tokenizer_model=PYLM / "tokenizer.model")
    for f in PYLM.glob("*.safetensors"):
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    shutil.copytree(d, d.with_name("w-sdsat"))
    (d.with_name("w-sdsat") / "sdsat.json").write_text('{"fingerprint": "0000000000000000", "adaptive": [4]}')
    return d


@pytest.mark.parametrize("spec, message", [
    ("medusa", "medusa.safetensors was trained for another base model"),
    ("propd", "medusa.safetensors was trained for another base model"),
    ("propd:prune=true", "was trained for another base model"),
    ("bita", "bita.safetensors was trained for another base model"),
    ("bita:prompting=shallow", "bita-shallow.safetensors was trained for another base model"),
    ("bita:prompting=none", "bita-none.safetensors was trained for another base model"),
    ("hidden_transfer", "hidden_transfer.safetensors was trained for another base model"),
    ("sdsat", "sdsat.safetensors was trained for another base model"),
    ("sdsat_full", "holds another model than the one loaded"),
])
def test_drafter_for_other_weights_is_refused(foreign, spec, message):
    assert message in run_cli(decode.main, "--weights", foreign, "--method", spec, "--prompt", "def f(x):")


def test_missing_drafter_weights_say_how_to_train_them(weights):
    assert "no medusa.safetensors in" in run_cli(decode.main, "--weights", weights, "--method", "medusa")
    assert "no sdsat.safetensors in" in run_cli(decode.main, "--weights", weights, "--method", "sdsat")
    assert "fine-tune one with python train.py --method sdsat_full" in run_cli(decode.main, "--weights", weights,
                                                                               "--method", "sdsat_full")


def test_every_command_line_defaults_to_the_shipped_model(monkeypatch):
    """decode.py, the oracle's compare and the analysis experiments find weights/pylm in the checkout (the last
    two once looked in nanospec/weights/)."""
    from nanospec import DEFAULT_WEIGHTS, NanospecError
    from nanospec.methods import analysis
    from nanospec.oracle import compare, engines
    assert (DEFAULT_WEIGHTS / "model.safetensors").is_file() and decode.parse_args([]).weights is None
    code, _, err = call(analysis.main, "heldout", "--methods", "nope")
    assert code == 2 and err.startswith("error: heldout --methods"), err  # past resolving the default model
    code, _, err = call(analysis.main, "heldout", "--drafters", "weights/pylm", "nowhere")
    assert code == 2 and err == "error: heldout --drafters nowhere: no medusa, hidden_transfer, bita, sdsat drafter " \
        "there\n", err
    seen = []

    def run(name, args):
        seen.append(args.weights)
        raise NanospecError("stop here")
    monkeypatch.setattr(engines, "run", run)
    code, _, err = call(compare.main, "--engine", "transformers")
    assert code == 2 and seen == [str(DEFAULT_WEIGHTS)], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_every_device_option_refuses_cuda_without_one_in_one_line():
    """decode.py (above), train.py and the teacher-forced data's command share one check (nanospec.check_device)."""
    import train
    from nanospec.training import forced
    for main, args in [(train.main, ["--method", "sdsat"]), (forced.main, ["--weights", "weights/pylm"])]:
        code, _, err = call(main, *args, "--device", "cuda")
        assert code == 2 and err == "error: --device cuda: no CUDA device is available; use --device cpu\n", err
