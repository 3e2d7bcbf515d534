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
from ...io.checkpoint import DTYPES, load
from ...io.files import fingerprint
from ...io.sources import base_of
from ...io.tokenizer import load_tokenizer
from .. import floors, forced, noise, whole
from .. import trace as traces

MODULES = {"transformers": "hf", "llama.cpp": "llamacpp", "openai": "openai"}
TOP_K = 8  # top-k kept per position of the reference, as in traces
ROWS_K = max(forced.KS)  # an in-process engine's rows: as many ids as the distance test reads


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


def top(row, k: int = ROWS_K) -> dict:
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


class Whole:
    """The whole-output test of a run's outputs against the reference (whole.py): nanospec fp32 scores them
    teacher-forced (forced.py) and each is judged against its noise (noise.py): a calibration's where it keeps
    one, else measured now (nanospec at the engine's dtype against fp32, on the reference's sequences). Each
    noise's detection floors (floors.py) are measured once, unless --no-floors. Off with --ulps (the
    first-difference rule at that tolerance) and without a reference (--self-only)."""

    def __init__(self, args, weights, fp32=None):
        self.args, self.weights, self.fp32, self.noises = args, weights, fp32, {}
        self.on = args.ulps is None

    def reference(self):
        if self.fp32 is None:
            self.fp32 = load(base_of(self.weights))
        return self.fp32

    def noise(self, refs, dtype: str, model=None, calibrated: list[dict] | None = None, source: str = "") -> dict:
        key = (dtype, source) if calibrated else (dtype, None)
        if key not in self.noises:
            fp32, planted = self.reference(), self.reference()
            nz = noise.from_calibration(calibrated or [], f"calibrated: {source}") if calibrated else None
            if calibrated and nz is None:  # a calibration that keeps no noise (an older file): no whole test
                self.noises[key] = None
                return None
            if nz is None:
                planted = fp32 if dtype == "float32" else model or load(base_of(self.weights), DTYPES[dtype])
                exact = dtype == "float32" and all(e.get("dtype", "float32") == "float32" for e in refs)
                nz = noise.measure(fp32, planted, refs, exact, f"nanospec {dtype} vs float32, measured now")
            if not self.args.no_floors:
                t0 = time.perf_counter()
                nz["floors"] = floors.floors(planted, fp32, refs, nz)
                print(f"[floors] {nz['source']}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            self.noises[key] = nz
        return self.noises[key]

    def of(self, refs, others, dtype: str, model=None, calibrated=None, source: str = "", echo: bool = False) -> dict:
        """{"whole": the verdict} for a run against refs, or {} when the test is off. echo: the others are the
        engine's rows at the reference's own tokens (forced.score_echo), not outputs of its own."""
        if not self.on or refs is None:
            return {}
        nz = self.noise(refs, dtype, model, calibrated, source)
        if nz is None:
            return {}
        agree = refs if all(e.get("dtype", "float32") == "float32" for e in refs) else None
        scores = forced.score_echo(self.reference(), others) if echo else \
            forced.score_run(self.reference(), agree, others)
        w = whole.test(scores, nz)
        return {"whole": {**w, **({"floors": nz["floors"]} if "floors" in nz else {})}}

    def own(self, greedy: list[dict], others: list[dict]) -> dict:
        """{"whole": the verdict} for an engine's speculative (or batched) run against its own plain run: both
        scored against nanospec fp32, the plain run's scores as the noise (noise.from_scores); {} when off."""
        if not self.on:
            return {}
        nz = noise.from_scores(forced.score_run(self.reference(), None, greedy), "the engine's own plain run")
        return {"whole": whole.test(forced.score_run(self.reference(), None, others), nz)}
