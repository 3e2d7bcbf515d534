"""--engine openai against a stub OpenAI-compatible server started here (standard library HTTP on
127.0.0.1): each response shape the README names maps back to the right ids, nanospec's own
greedy output served over HTTP is identical to the reference, a planted speculation bug is a
divergence against the reference and against the server's own greedy output, and bad servers
end in one error line."""
import json

import pytest

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
    assert all(r["temperature"] == 0 and r["top_k"] == 1 and r["repeat_penalty"] == 1 and r["logprobs"] == 5
               for r in sent)
    assert all(isinstance(r["prompt"], list if prompt_as == "ids" else str) for r in sent)
    assert len(stub.requests) == (4 if prompt_as == "text" else 2)  # text: an echo request checks the prompt tokens


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
