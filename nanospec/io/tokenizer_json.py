"""A weights directory's tokenizer.json, through the `tokenizers` library, with the special ids
transformers would use.

transformers (5.x) builds a tokenizer.json tokenizer from the file alone: its post-processor
decides whether BOS (or EOS) is added, and tokenizer_config.json's add_bos_token is ignored.
The named tokens (bos_token, eos_token, pad_token) come from tokenizer_config.json; where it
lacks one, config.json's id stands in. Generation stops at generation_config.json's
eos_token_id (an id or a list), else config.json's: `stop_ids`.
"""
import hashlib
import json
from pathlib import Path

import tokenizers

from .. import NanospecError


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NanospecError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise NanospecError(f"{path} is not a JSON object")
    return data


def ids_of(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


class JsonTokenizer:
    def __init__(self, path):
        path = Path(path)
        file = path / "tokenizer.json"
        try:
            self.tk = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the library reports a bad file as a bare Exception
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NanospecError(f"{file} is not a tokenizer the tokenizers library can read ({why})") from None
        self.blob = file.read_bytes()
        self.config = read_json(path / "tokenizer_config.json")
        model_cfg = read_json(path / "config.json")
        gen_cfg = read_json(path / "generation_config.json")
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.bos_id = self.special("bos_token", model_cfg.get("bos_token_id"))
        self.eos_id = self.special("eos_token", (ids_of(model_cfg.get("eos_token_id")) or [None])[0])
        self.pad_id = self.special("pad_token", model_cfg.get("pad_token_id"))
        stop = ids_of(gen_cfg.get("eos_token_id")) or ids_of(model_cfg.get("eos_token_id"))
        self.stop_ids = stop or ids_of(self.eos_id)

    def special(self, name: str, fallback):
        token = self.config.get(name)
        if isinstance(token, dict):  # a serialized AddedToken
            token = token.get("content")
        tid = self.tk.token_to_id(token) if isinstance(token, str) else None
        return tid if tid is not None else fallback

    @property
    def identity(self) -> str:
        return hashlib.sha256(self.blob).hexdigest()[:12]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """bos=True: the special tokens the file's post-processor adds (transformers' default);
        False: the text's tokens alone."""
        return self.tk.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def token_id(self, piece: str) -> int | None:
        return self.tk.token_to_id(piece)
