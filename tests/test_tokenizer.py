"""The shipped tokenizer: lossless on any text, byte fallback, special and reserved ids."""
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nanospec.io.tokenizer import N_RESERVED, Tokenizer

TOK = Tokenizer(Path(__file__).resolve().parents[1] / "weights" / "pylm" / "tokenizer.model")


@given(st.text(max_size=200))
def test_round_trip_any_text(text):
    ids = TOK.encode(text, bos=False)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


@given(st.text(alphabet=st.sampled_from(" \t\n\u2581x_(:"), max_size=40))
def test_round_trip_whitespace_and_space_meta(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_byte_fallback_and_specials():
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id, TOK.sp.unk_id()) == (1, 2, 3, 0)
    ids = TOK.encode("\U0001F600", bos=False)  # not in the vocabulary: its four UTF-8 bytes
    assert [TOK.sp.id_to_piece(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert TOK.sp.unk_id() not in TOK.encode("\U0001F600 \u00e9\u65e5\x00\r")
    assert 4000 <= TOK.vocab_size <= 8192 and TOK.encode("x")[0] == TOK.bos_id


def test_reserved_ids_are_never_produced_by_encode():
    reserved = {TOK.token_id(f"<reserved_{i}>") for i in range(N_RESERVED)}
    assert len(reserved) == N_RESERVED
    text = "".join(f"<reserved_{i}>" for i in range(N_RESERVED)) + " def f(): pass"
    assert not reserved & set(TOK.encode(text))
    assert TOK.decode(TOK.encode(text)) == text
