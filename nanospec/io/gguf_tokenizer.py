"""A GGUF's tokenizer as tokenizer.json + tokenizer_config.json, built with the `tokenizers` library.

A GGUF stores the vocabulary, the merges, each token's type and the special ids as metadata
(tokenizer.ggml.*), plus the name of the pre-tokenizer (`pre`): llama.cpp splits text with a
fixed list of regexes per name before BPE. PRE gives those splits in tokenizers' terms, for the
byte-level BPE ("gpt2") vocabularies that llama, qwen2 and qwen3 files use; other names are refused
rather than guessed, since a wrong split changes the ids without any error.
"""
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .. import NanospecError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one


def split_then_bytes(regex: str):  # tokenizer.json's form of llama.cpp's regex pre-tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"), byte_level(False)])


def byte_level(use_regex: bool):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def digits_then_gpt2():  # every digit alone, then GPT-2's regex (SmolLM's and StarCoder's tokenizer.json too)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level(True)])


# pre name -> (pre-tokenizer, ignore_merges); llama.cpp: llama-vocab.cpp, by the same names
PRE = {
    "default": lambda: (byte_level(True), False),  # GPT-2's regex
    "gpt-2": lambda: (byte_level(True), False),
    "smollm": lambda: (digits_then_gpt2(), False),
    "starcoder": lambda: (digits_then_gpt2(), False),
    "llama-bpe": lambda: (split_then_bytes(LLAMA3_SPLIT), True),
    "qwen2": lambda: (split_then_bytes(QWEN2_SPLIT), False),
}


def field(meta: dict, key: str, default=None, required=True):
    if key in meta:
        return meta[key]
    if required and default is None:
        raise NanospecError(f"the GGUF has no {key} (its tokenizer is incomplete)")
    return default


def build(meta: dict, context_length: int | None = None) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) from a GGUF's metadata."""
    kind = field(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NanospecError(f"the GGUF's tokenizer is {kind!r}; nanospec converts byte-level BPE ('gpt2') "
                            "tokenizers only")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE:
        raise NanospecError(f"the GGUF's pre-tokenizer {pre!r} is not one nanospec knows ({', '.join(PRE)})")
    tokens = list(field(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in field(meta, "tokenizer.ggml.merges")]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise NanospecError("the GGUF's tokenizer metadata is inconsistent (duplicate tokens, a merge that "
                            "is not a pair, or a token_type list of another length)")
    pre_tok, ignore_merges = PRE[pre]()
    try:
        tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    except Exception as e:
        raise NanospecError(f"the GGUF's vocabulary and merges do not make a BPE model ({e})") from None
    tk.pre_tokenizer = pre_tok
    tk.decoder = decoders.ByteLevel()
    # control tokens (<|im_end|>) are special; user-defined ones are matched whole but not special
    tk.add_tokens([AddedToken(t, special=ty == CONTROL, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])

    name = lambda key: tokens[meta[key]] if 0 <= meta.get(key, -1) < len(tokens) else None
    bos, eos = name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(dict(specials).items()))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": name("tokenizer.ggml.unknown_token_id"),
              "pad_token": name("tokenizer.ggml.padding_token_id"),
              "add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    if context_length:
        config["model_max_length"] = context_length
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tk.to_str(), config

