"""tokenizer.json tokenizers: the ids transformers' AutoTokenizer gives on the same directory,
over a few thousand lines of code, prose, unicode and special tokens; BOS as the file says."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gguf_files import write_gguf
from helpers import SPECIALS, mixed_lines
from nanospec import NanospecError
from nanospec.io import gguf_tokenizer
from nanospec.io.convert import convert
from nanospec.io.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return convert(write_gguf(d / "tiny.gguf", "Q8_0"), d / "hf"), d / "tiny.gguf"


def test_ids_equal_autotokenizer(tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny[0])
    tok, lines = load_tokenizer(tiny[0]), mixed_lines()
    assert len(lines) > 3000
    for line, a, b in zip(lines, ref(lines)["input_ids"], ref(lines, add_special_tokens=False)["input_ids"]):
        assert tok.encode(line) == a and tok.encode(line, bos=False) == b, line
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 2)


def test_same_ids_as_transformers_gguf_tokenizer(tiny):
    """transformers builds its own tokenizer from the GGUF: for GPT-2's pre-tokenizer the two agree."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny[1].parent, gguf_file=tiny[1].name)
    tok = load_tokenizer(tiny[0])
    lines = mixed_lines(200)[::3]
    for line, ids in zip(lines, ref(lines)["input_ids"]):
        assert tok.encode(line) == ids, line


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path):
    # llama.cpp's "smollm" splits \p{N} first, then GPT-2's regex: "x  12 3" is x, "  ", 1, 2, " ", 3
    # (GPT-2's regex alone, transformers' GGUF tokenizer for it, gives x, " ", " 12", " 3")
    tok = load_tokenizer(convert(write_gguf(tmp_path / "s.gguf", pre="smollm"), tmp_path / "hf"))
    pieces = [p for p, _ in tok.tk.pre_tokenizer.pre_tokenize_str("x  12 3")]
    assert pieces == ["x", "ĠĠ", "1", "2", "Ġ", "3"]


def test_bos_follows_the_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = convert(write_gguf(tmp_path / "b.gguf", add_bos=True), tmp_path / "hf")
    tok, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    assert tok.encode("def f():") == ref("def f():")["input_ids"] and tok.encode("def f():")[0] == 1
    assert tok.encode("def f():", bos=False)[0] != 1


@given(text=st.text(max_size=80))
def test_round_trip(tiny, text):  # byte-level BPE: any text, special-token strings included
    tok = load_tokenizer(tiny[0])
    assert tok.decode(tok.encode(text, bos=False)) == text


def test_identity_and_reserved(tiny):
    tok = load_tokenizer(tiny[0])
    assert tok.identity == load_tokenizer(tiny[0]).identity and len(tok.identity) == 12
    assert tok.token_id("<reserved_0>") is None
    assert tok.token_id("<|im_end|>") == 2 and tok.token_id("<no such token>") is None


def test_control_tokens_are_special_user_defined_ones_are_not(tiny):
    """llama.cpp's CONTROL tokens (type 3) become special added tokens, dropped by skip_special_tokens;
    USER_DEFINED ones (4) are matched whole but not special; normal ones (1) are no added tokens."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<|im_end|>", "<tool>"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3, 4]}
    text, _ = gguf_tokenizer.build(meta)
    added = json.loads(text)["added_tokens"]
    assert {t["content"]: t["special"] for t in added} == {"<|im_end|>": True, "<tool>": False}
    tk = Tokenizer.from_str(text)
    ids = tk.encode("ab<|im_end|><tool>a").ids
    assert ids == [2, 3, 4, 0] and tk.decode(ids, skip_special_tokens=True) == "ab<tool>a"
    added = json.loads((tiny[0] / "tokenizer.json").read_text())["added_tokens"]  # from a GGUF file
    assert {t["content"]: t["special"] for t in added} == dict.fromkeys(SPECIALS, True)


def test_tokenizer_json_without_a_model(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": []}')
    with pytest.raises(NanospecError, match="tokenizer.json is not a tokenizer"):
        load_tokenizer(tmp_path)
