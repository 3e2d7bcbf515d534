"""SmolLM2-135M-Instruct, the real model (run only where `python -m nanospec.fetch smollm2` has
fetched it): fp32 logits and greedy ids as transformers' on the same directory, its tokenizer
as AutoTokenizer's, its chat template as apply_chat_template's."""
import pytest
import torch

from helpers import full_logits
from nanospec import chat, fetch
from nanospec.checkpoint import load
from nanospec.engine import generate
from nanospec.tokenizer import load_tokenizer
from test_tokenizer_json import mixed_lines

DIR = fetch.converted("smollm2")
pytestmark = pytest.mark.skipif(not (DIR / "config.json").is_file(),
                                reason="SmolLM2 is not fetched: python -m nanospec.fetch smollm2")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\n# 2024-01-31:"]


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.LlamaForCausalLM.from_pretrained(DIR, dtype=torch.float32).eval()
    return load(DIR), hf, transformers.AutoTokenizer.from_pretrained(DIR)


def test_logits_and_greedy_match_transformers(models):
    model, hf, ref_tok = models
    tok = load_tokenizer(DIR)
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
    ref = models[2]
    tok = load_tokenizer(DIR)
    lines = mixed_lines()
    assert [tok.encode(line) for line in lines] == ref(lines)["input_ids"]
    msg = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    ids, stop = chat.prompt_ids(DIR, tok, msg[0]["content"])
    assert chat.render(msg[0]["content"], chat.template(DIR), tok.config) == ref.apply_chat_template(
        msg, tokenize=False, add_generation_prompt=True)
    assert ids == list(ref.apply_chat_template(msg, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert stop == tok.token_id("<|im_end|>") == 2
