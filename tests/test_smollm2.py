"""SmolLM2-135M-Instruct, the real model (run only where `python -m nanospec.io.fetch smollm2` has
downloaded it): fp32 logits and greedy ids as transformers' on the same directory, its tokenizer
as AutoTokenizer's, its chat template as apply_chat_template's. The fetched GGUF is converted
afresh with the current convert.py (not read from the cache's earlier conversion)."""
from pathlib import Path

import pytest
import torch

from helpers import full_logits, mixed_lines
from nanospec.engine import generate
from nanospec.io import chat, fetch
from nanospec.io.checkpoint import load
from nanospec.io.convert import convert
from nanospec.io.files import cache_root
from nanospec.io.tokenizer import load_tokenizer

_, MEMBER, DIGEST = fetch.MODELS["smollm2"]
GGUF = cache_root() / "downloads" / Path(MEMBER).name
pytestmark = pytest.mark.skipif(not GGUF.is_file(),
                                reason="SmolLM2 is not fetched: python -m nanospec.io.fetch smollm2")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\n# 2024-01-31:"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d = tmp_path_factory.mktemp("smollm2")
    convert(GGUF, d, sha256=DIGEST)
    hf = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, load(d), hf, transformers.AutoTokenizer.from_pretrained(d)


def test_logits_and_greedy_match_transformers(models):
    d, model, hf, ref_tok = models
    tok = load_tokenizer(d)
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids == ref_tok(text)["input_ids"]
        out = generate(model, ids, max_new_tokens=16, eos_id=-1)
        seq = ids + out.tokens
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        assert (full_logits(model, seq, exact=False) - ref).abs().max() <= 1e-4
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=2, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.tokens == hf_out[0, len(ids):].tolist(), text


def test_tokenizer_and_chat_template(models):
    d, ref = models[0], models[3]
    tok = load_tokenizer(d)
    lines = mixed_lines()
    assert [tok.encode(line) for line in lines] == ref(lines)["input_ids"]
    msg = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    ids, stop = chat.prompt_ids(d, tok, msg[0]["content"])
    assert chat.render(msg[0]["content"], chat.template(d), tok.config) == ref.apply_chat_template(
        msg, tokenize=False, add_generation_prompt=True)
    assert ids == list(ref.apply_chat_template(msg, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert stop == tok.token_id("<|im_end|>") == 2
