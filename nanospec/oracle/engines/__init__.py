"""Engines under test for `nanospec.oracle.compare --engine`, one module each, imported only when named:

- transformers (hf.py): AutoModelForCausalLM.generate, greedy / prompt lookup / assisted;
- llama.cpp (llamacpp.py): llama-cpp-python (an optional extra), greedy / prompt lookup / draft model;
- openai (openai.py): any OpenAI-compatible completions server, over HTTP (standard library).

What they share is here: the prompts (tokenized once, on nanospec's side), nanospec's reference
(exact AR, or a trace file given as REFERENCE), each engine's own top-k rows (for
self-consistency), progress lines and --save. Every engine returns runs: dicts with engine,
setting, against ("reference", or "greedy": the engine's speculative output against its own
greedy output) and results (compare.compare's verdicts), plus what it measured.
"""
import importlib
import sys
import time
from pathlib import Path

import numpy as np

from ... import NanospecError
from ...bench import load_prompts
from ...engine import generate
from ...io.files import fingerprint
from ...io.sources import base_of
from ...io.tokenizer import load_tokenizer
from .. import trace as traces

MODULES = {"transformers": "hf", "llama.cpp": "llamacpp", "openai": "openai"}
TOP_K = 8  # top-k kept per position, as in traces


def run(name: str, args) -> list[dict]:
    return importlib.import_module(f".{MODULES[name]}", __name__).run(args)


def progress(tag: str, i: int, n: int, t0: float) -> None:
    left = (time.perf_counter() - t0) / (i + 1) * (n - i - 1)
    print(f"[{tag}] prompt {i + 1}/{n}, {left:.0f}s left", file=sys.stderr, flush=True)


def prompt_texts(args, weights: Path) -> list[str]:
    return load_prompts(Path(args.prompts) if args.prompts else weights / "prompts.jsonl")[:args.limit]


def tokenizer(weights: Path):
    tok = load_tokenizer(base_of(weights))
    if tok is None:
        raise NanospecError(f"{weights} has no tokenizer.json or tokenizer.model to encode the prompts with")
    return tok


def top(row, k: int = TOP_K) -> dict:
    """A row's k largest logits as a trace position (ids and fp32 values, largest first; numpy, so
    that an engine's loop does not wake torch's threads)."""
    row = np.asarray(row, dtype=np.float32)
    ids = np.argpartition(row, -k)[-k:] if len(row) > k else np.arange(len(row))
    ids = ids[np.lexsort((ids, -row[ids]))]  # by value, ties by id, as torch's argmax picks the first
    return {"top_ids": ids.tolist(), "top_logits": row[ids].tolist()}


def reference(model, prompts, max_new_tokens, k=TOP_K) -> list[dict]:
    """nanospec's exact-mode AR trace of each prompt: the reference."""
    meta = dict(method="ar", mode="exact", dtype=str(model.embed.weight.dtype).removeprefix("torch."),
                device=model.embed.weight.device.type, model=fingerprint(model), eos_id=model.args.eos_id,
                temperature=0.0)
    entries, t0 = [], time.perf_counter()
    for i, p in enumerate(prompts):
        out = generate(model, p, max_new_tokens=max_new_tokens, exact=True, record_logits=True)
        entries.append(traces.record(p, out.tokens, out.logits, k, **meta))
        progress("nanospec ar exact", i, len(prompts), t0)
    return entries


def references(args, model, prompts) -> list[dict] | None:
    """The reference: REFERENCE (a trace file of the same weights) when given, else traced now;
    None with --self-only (self-consistency needs none)."""
    if args.self_only:
        return None
    if not args.reference:
        return reference(model, prompts, args.max_new_tokens)
    given = {tuple(e["prompt_ids"]): e for e in traces.read(args.reference, full=True)}
    fp = fingerprint(model)
    out = []
    for p in prompts:
        e = given.get(tuple(p))
        if e is None:
            raise NanospecError(f"{args.reference} does not trace every prompt: trace them with --save, or "
                                "decode.py --mode exact --trace, with the same --prompts and --limit")
        if e.get("model") not in (None, fp):
            raise NanospecError(f"{args.reference} traces other weights than --weights (fingerprint {e['model']}, "
                                f"these {fp})")
        if len(e["output_ids"]) < args.max_new_tokens and e["output_ids"][-1:] != [e.get("eos_id")]:
            raise NanospecError(f"{args.reference} holds fewer than --max-new-tokens {args.max_new_tokens} "
                                "tokens for a prompt")
        n = args.max_new_tokens
        out.append({**e, "output_ids": e["output_ids"][:n], "positions": e["positions"][:n]})
    return out


def save(args, name: str, entries: list[dict] | None) -> None:
    if args.save and entries is not None:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        traces.write(Path(args.save) / f"{name}.jsonl", entries)


def tokens_per_s(outputs: list[dict]) -> float | None:
    """Decoding speed over a run: new tokens after the first, over the time after the first
    (prefill excluded, as nanospec's bench excludes it)."""
    n = sum(max(len(o["output_ids"]) - 1, 0) for o in outputs)
    s = sum(o.get("decode_s", 0.0) for o in outputs)
    return round(n / s, 2) if s > 0 else None
