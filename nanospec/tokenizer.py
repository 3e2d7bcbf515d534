"""A thin sentencepiece wrapper (Llama style: BOS prepended, byte fallback)."""
from pathlib import Path

import sentencepiece as spm

from . import NanospecError


class Tokenizer:
    def __init__(self, model_file):
        model_file = Path(model_file)
        if not model_file.is_file():
            raise NanospecError(f"no tokenizer at {model_file}: the weights directory needs a tokenizer.model")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos and self.bos_id >= 0 else []) + self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))
