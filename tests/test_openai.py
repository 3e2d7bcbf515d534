"""--engine openai against a stub OpenAI-compatible server started here (standard library HTTP on
127.0.0.1): each response shape the README names maps back to the right ids, nanospec's own
greedy output served over HTTP is identical to the reference, a planted speculation bug is a
divergence against the reference and against the server's own greedy output, and bad servers
end in one error line."""
import json

import pytest
import torch

from gguf_files import ascii_model
from helpers import call, run_cli
from nanospec.io.checkpoint import load
from nanospec.io.tokenizer import load_tokenizer
from nanospec.oracle import compare
from nanospec.oracle.engines.openai import Pieces, parse
from openai_stub import Stub


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = ascii_model(tmp_path_factory.mktemp("openai"))
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def f(x):\n    return", "import os\n"]))
    return d, load(d), load_tokenizer(d), prompts


def engine(served, url, *more):
    d, _, _, prompts = served
    code, out, err = call(compare.main, "--engine", "openai", "--url", url, "--weights", d, "--prompts", prompts,
                          "--max-new-tokens", 10, "--json", *more)
    return code, (json.loads(out.splitlines()[-1])["runs"] if code in (0, 1) else None), out + err


@pytest.mark.parametrize("shape, prompt_as", [("vllm", "ids"), ("llama-server", "ids"), ("text", "text")])
def test_each_response_shape_maps_back_to_the_reference(served, shape, prompt_as):
    _, model, tok, _ = served
    with Stub(model, tok, shape, refuse_ids=prompt_as == "text") as stub:
        code, runs, text = engine(served, stub.url, "--prompt-as", prompt_as)
    assert code == 0, text
    (run,) = runs
    assert run["against"] == "reference" and run["summary"]["identical"] == 2, text
    sent = [r for r in stub.requests if not r["echo"]]
    assert all(r["temperature"] == 0 and r["top_k"] == 1 and r["repeat_penalty"] == 1 and r["logprobs"] == 20
               for r in sent)
    assert all(isinstance(r["prompt"], list if prompt_as == "ids" else str) for r in sent)
    # the logprobs probe, the 2 prompts, and 2 echo requests: text checks the prompt tokens, ids asks for rows at
    # the reference's tokens (this server lists none for echoed tokens: no echo run)
    assert len(stub.requests) == 5 and len(sent) == 3


def test_a_planted_speculation_bug_is_a_divergence_against_both(served):
    _, model, tok, _ = served
    with Stub(model, tok) as greedy, Stub(model, tok, flip_at=3) as spec:
        code, runs, text = engine(served, spec.url, "--greedy-url", greedy.url)
    assert code == 1, text
    by = {(r["setting"], r["against"]): r for r in runs}
    assert by[(greedy.url, "reference")]["summary"]["identical"] == 2
    for key in ((spec.url, "reference"), (spec.url, "greedy")):
        assert [(r["verdict"], r["position"]) for r in by[key]["results"]] == [("divergence", 3)] * 2, text
    assert f"openai {spec.url} vs its own greedy: 2 prompts: 0 identical, 0 near-tie, 2 divergence" in text
    assert by[(spec.url, "greedy")]["whole"]["verdict"] == "divergence"
    assert "greedy" in text and "speculative" in text


def test_self_only_needs_no_reference(served):
    _, model, tok, _ = served
    with Stub(model, tok) as greedy, Stub(model, tok, flip_at=5) as spec:
        code, runs, text = engine(served, spec.url, "--greedy-url", greedy.url, "--self-only")
        assert "add --greedy-url" in run_cli(compare.main, "--engine", "openai", "--url", spec.url, "--self-only")
    assert code == 1 and "nanospec ar exact" not in text
    (run,) = runs
    assert run["against"] == "greedy" and [r["position"] for r in run["results"]] == [5, 5]


def test_pieces_and_parse():
    class Tok:
        vocab_size, bos_id = 4, None

        def decode(self, ids):
            return ["a", "b", "b", "c"][ids[0]]
    pieces = Pieces(Tok())
    assert pieces.id("a", "x") == 0 and pieces.id("token_id:2", "x") == 2
    with pytest.raises(Exception, match="names 2 tokens"):
        pieces.id("b", "prompt 0, token 1")
    ids, rows = parse({"logprobs": {"tokens": ["a", "c"], "top_logprobs": [{"a": -0.1, "c": -2.5, "b": -3},
                                                                            {"c": -0.2}]}}, pieces, "p")
    assert ids == [0, 3] and rows[0]["top_ids"] == [0, 3] and rows[0]["top_logits"] == [-0.1, -2.5]
    ids, rows = parse({"logprobs": {"content": [{"id": 2, "token": "b", "logprob": -0.5, "top_logprobs": [
        {"id": 2, "logprob": -0.5}, {"id": 1, "logprob": -0.6}]}]}}, pieces, "p")
    assert ids == [2] and rows[0]["top_ids"] == [2, 1]
    ids, _ = parse({"token_ids": [1, 2], "logprobs": {"tokens": ["b", "b"], "top_logprobs": [{}, {}]}}, pieces, "p")
    assert ids == [1, 2]  # SGLang's return_token_ids: ids as given, even where texts are ambiguous
    with pytest.raises(Exception, match="returned no logprobs.tokens"):
        parse({"logprobs": [-0.1, -0.2]}, pieces, "p")  # TGI's /v1/completions: floats only


def test_bad_servers_are_one_line_errors(served):
    _, model, tok, prompts = served
    assert "needs --url" in run_cli(compare.main, "--engine", "openai", "--weights", served[0])
    with Stub(model, tok, refuse_ids=True) as stub:
        msg = run_cli(compare.main, "--engine", "openai", "--url", stub.url, "--weights", served[0], "--prompts",
                      prompts, "--max-new-tokens", 4)
    assert "answered HTTP 422" in msg and "--prompt-as text" in msg
    with Stub(model, tok) as stub:
        url = stub.url
    assert "cannot reach" in run_cli(compare.main, "--engine", "openai", "--url", url, "--weights", served[0],
                                     "--prompts", prompts, "--max-new-tokens", 4)
    assert "cannot be calibrated" in run_cli(compare.main, "--engine", "openai", "--url", url, "--calibrate")


def test_a_planted_batch_dependence_is_caught(served):
    """--concurrency 2: the prompts again, both in flight at once. A stub that answers otherwise when
    requests overlap is a divergence against the reference and against each prompt sent alone (the
    lone answers stay identical), or, with a tolerance wide enough to cover the planted gap, a
    near-tie: never identical. A batch-invariant server is identical."""
    _, model, tok, _ = served
    with Stub(model, tok, batch_flip_at=3) as stub:
        code, runs, text = engine(served, stub.url, "--concurrency", 2)
        wide_code, wide, _ = engine(served, stub.url, "--concurrency", 2, "--ulps", 1e12)
    assert code == 1, text
    by = {(r["setting"], r["against"]): r for r in runs}
    assert by[(stub.url, "reference")]["summary"]["identical"] == 2
    batched = f"{stub.url} concurrency 2"
    for key in ((batched, "reference"), (batched, "alone")):
        assert [(r["verdict"], r["position"]) for r in by[key]["results"]] == [("divergence", 3)] * 2, text
    assert f"openai {batched} vs each prompt alone: 2 prompts: 0 identical, 0 near-tie, 2 divergence" in text
    assert "alone" in text and "batched" in text
    assert wide_code == 0 and [r["verdict"] for r in wide[-1]["results"]] == ["near-tie"] * 2
    with Stub(model, tok) as fair:
        code, runs, text = engine(served, fair.url, "--concurrency", 2)
    assert code == 0 and runs[-1]["against"] == "alone" and runs[-1]["summary"]["identical"] == 2, text


@pytest.fixture(scope="module")
def served8(served, tmp_path_factory):
    """The same model with its output norm's weight x 0.05 (logits x 0.05: its rows hold distributions to move, not
    one certain token), and 8 prompts (the distance test resamples prompts)."""
    import shutil

    from nanospec.io.checkpoint import save
    src, model, tok, _ = served
    d = tmp_path_factory.mktemp("openai8")
    soft = load(src)
    with torch.no_grad():
        soft.norm.weight.mul_(0.05)
    save(soft, d)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, d / f)
    model = load(d)
    prompts = d / "p.jsonl"
    texts = ["def f(x):\n    return", "import os\n", "class A:\n", "for i in range(", "x = [", "while True:",
             "print(", "if a == b:"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return d, model, tok, prompts


def test_the_largest_logprobs_and_the_echo_rows(served8):
    """The server is asked for as many top log-probabilities as it allows (20 refused, 10 taken), and where echo
    lists them, it is also scored at the reference's own tokens: a run of its own, judged whole, passed."""
    _, model, tok, _ = served8
    with Stub(model, tok, max_logprobs=10, echo_rows=True) as stub:
        code, runs, text = engine(served8, stub.url, "--no-floors")
    assert code == 0, text
    asked = [r["logprobs"] for r in stub.requests]
    assert asked[:2] == [20, 10] and set(asked[2:]) == {10}, asked
    by = {r["setting"]: r for r in runs}
    echo = by[f"{stub.url} (echo: at the reference's tokens)"]
    assert echo["whole"]["verdict"] == "pass" and echo["whole"]["distance"]["k"] == 8, text
    assert by[stub.url]["whole"]["distance"]["k"] == 8 and "lists 10 top log-probabilities" in text


def test_a_bug_that_flips_no_token_is_seen_through_rows_alone(served8):
    """Log-probabilities returned at a temperature move every distribution and no argmax: with the server's rows
    the distance test makes it a divergence; a server that lists one log-probability (ids only) passes it, and
    the run says it could see little."""
    _, model, tok, _ = served8
    with Stub(model, tok, logit_scale=0.7) as bad, Stub(model, tok, logit_scale=0.7, max_logprobs=1) as blind:
        code, runs, text = engine(served8, bad.url, "--no-floors")
        assert code == 1 and runs[0]["summary"]["identical"] == 8, text
        w = runs[0]["whole"]
        assert w["verdict"] == "divergence" and w["flips"] == 0 and w["log10_p_tests"]["distance"] < -4.6, text
        code, runs, text = engine(served8, blind.url, "--no-floors")
    assert code == 0 and runs[0]["whole"]["distance"] is None, text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  distances: none"))
    assert lines[at + 1].startswith("  this run could see little: ids only") and lines[at + 2].startswith("{"), text


def test_speculation_is_judged_whole_against_the_engines_own_plain_run(served8):
    """--self-only: a speculative server whose rows come at a temperature, against the same engine's plain server,
    is a divergence by the distances (no flip); the plain server against itself passes."""
    _, model, tok, _ = served8
    with Stub(model, tok) as greedy, Stub(model, tok, logit_scale=0.7) as spec:
        code, runs, text = engine(served8, spec.url, "--greedy-url", greedy.url, "--self-only")
        assert code == 1 and runs[0]["whole"]["flips"] == 0, text
        assert runs[0]["whole"]["distance"]["paired"] and runs[0]["whole"]["log10_p_tests"]["distance"] < -4.6, text
        code, runs, text = engine(served8, greedy.url, "--greedy-url", greedy.url, "--self-only")
    assert code == 0 and runs[0]["whole"]["verdict"] == "pass", text
