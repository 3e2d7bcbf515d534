"""Chat prompts: render a model's chat template with jinja2, the way transformers'
apply_chat_template(..., add_generation_prompt=True) does, and find the token that ends a turn.

The template is chat_template.jinja in the weights directory, else tokenizer_config.json's
"chat_template" (a string, or a list of {"name", "template"}: the one named "default").
Templates are untrusted code from the hub, so they run in jinja2's immutable sandbox.
"""
import json
from datetime import datetime
from pathlib import Path

from .. import NanospecError
from .tokenizer_json import read_json

# turn-ending tokens of common templates (llama.cpp keeps a list like this for the same purpose)
END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>"]


def template(path) -> str:
    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    t = read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if not isinstance(t, str) or not t.strip():
        raise NanospecError(f"{path} has no chat template (chat_template.jinja, or \"chat_template\" in "
                            "tokenizer_config.json): drop --chat and write the prompt yourself")
    return t


def render(text: str, tmpl: str, tokenizer_config: dict, system: str | None = None) -> str:
    """The prompt for one user message, ending where the assistant's reply begins."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    specials = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = tokenizer_config.get(name)
        if v is not None:
            specials[name] = v.get("content") if isinstance(v, dict) else v
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    try:
        return env.from_string(tmpl).render(messages=messages, add_generation_prompt=True, **specials)
    except Exception as e:  # a template is a program: whatever it raises (syntax, raise_exception) is its failure
        raise NanospecError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


def end_of_turn(tok, tmpl: str) -> int:
    """The id that ends the assistant's turn: the first known end-of-turn token that the template
    writes and the vocabulary holds, else the tokenizer's EOS."""
    for name in END_OF_TURN:
        if name in tmpl:
            tid = tok.token_id(name)
            if tid is not None:
                return tid
    if tok.eos_id is None:
        raise NanospecError("the chat template names no end-of-turn token this tokenizer knows, and it has no EOS")
    return tok.eos_id


def prompt_ids(path, tok, text: str, system: str | None = None) -> tuple[list[int], int]:
    """(ids of the rendered prompt, the end-of-turn id to stop at). The template writes any BOS
    itself, so the text is encoded without special tokens (as transformers does)."""
    tmpl = template(path)
    config = getattr(tok, "config", None) or read_json(Path(path) / "tokenizer_config.json")
    return tok.encode(render(text, tmpl, config, system), bos=False), end_of_turn(tok, tmpl)
