"""A thin sentencepiece wrapper (Llama style: BOS prepended, byte fallback), its trainer, and
load_tokenizer(dir): a weights directory's tokenizer, tokenizer.json or tokenizer.model.

The trained tokenizer is BPE with byte fallback, so any text round-trips: characters
outside the vocabulary become their UTF-8 bytes. Normalization is off and whitespace
is kept as is (code's indentation is data). Ids: 0 unk, 1 <s>, 2 </s>, 3 <pad>, then
N_RESERVED control ids <reserved_i> that never come out of encode(): later methods
claim them (SDSAT's adaptive tokens).
"""
import hashlib
import io
from pathlib import Path

import sentencepiece as spm

from .. import NanospecError

N_RESERVED = 32
SPACE_META = "\u2581"


class Tokenizer:
    def __init__(self, model_file):
        model_file = Path(model_file)
        if not model_file.is_file():
            raise NanospecError(f"no tokenizer at {model_file}: the weights directory needs a tokenizer.model")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()
        self.vocab_size = self.sp.get_piece_size()
        # sentencepiece writes spaces as U+2581 and so would decode a literal U+2581 as a
        # space; we encode that character as its UTF-8 bytes so every text round-trips.
        self.meta_bytes = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_META.encode()]
        if self.sp.unk_id() in self.meta_bytes:
            self.meta_bytes = None  # no byte fallback: nothing better to do

    @property
    def identity(self) -> str:
        """A stable hash of what the tokenizer does (caches of token ids are keyed by it)."""
        return hashlib.sha256(self.sp.serialized_model_proto()).hexdigest()[:12]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = [self.bos_id] if bos and self.bos_id >= 0 else []
        parts = text.split(SPACE_META) if self.meta_bytes else [text]
        for i, part in enumerate(parts):
            ids += (self.meta_bytes if i else []) + self.sp.encode(part)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def token_id(self, piece: str) -> int | None:
        pid = self.sp.piece_to_id(piece)
        return None if pid == self.sp.unk_id() and piece != self.sp.id_to_piece(pid) else pid



def load_tokenizer(path):
    """The tokenizer of a weights directory: tokenizer.json first (as transformers does), else
    tokenizer.model; None when it has neither."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        from .tokenizer_json import JsonTokenizer
        return JsonTokenizer(path)
    if (path / "tokenizer.model").is_file():
        return Tokenizer(path / "tokenizer.model")
    return None


def train_tokenizer(texts, vocab_size: int) -> bytes:
    """Train on an iterable of documents; returns the serialized model.

    Sentencepiece reads sentences, so documents are fed line by line: no piece spans a
    newline, and "\\n" itself is the byte token <0x0A>.
    """
    lines = (line for text in texts for line in text.split("\n") if line.strip())
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        control_symbols=[f"<reserved_{i}>" for i in range(N_RESERVED)],
        character_coverage=0.9999, max_sentence_length=1 << 16, input_sentence_size=2_000_000,
        shuffle_input_sentence=True, num_threads=2, minloglevel=2)
    return model.getvalue()
