"""Check another engine's greedy output against nanospec's reference trace, or against itself.

    python -m nanospec.oracle.compare REFERENCE.jsonl OTHER.jsonl [--dtype bfloat16] [--calibration FILE] [--json]
    python -m nanospec.oracle.compare --engine transformers [--weights DIR] [--dtype float32,bfloat16]
    python -m nanospec.oracle.compare --engine llama.cpp --weights FILE.gguf [--kv f16,f32]
    python -m nanospec.oracle.compare --engine openai --url http://HOST:PORT/v1 --weights FILE.gguf
    python -m nanospec.oracle.compare [REFERENCE.jsonl] --engine E --calibrate [--save-calibration FILE]
    python -m nanospec.oracle.compare --engine E --self-only      # speculative vs the engine's own greedy only
    python -m nanospec.oracle.compare --engine transformers --batch 4     # does batching change the output?
    python -m nanospec.oracle.compare --engine openai --url URL --concurrency 8

REFERENCE is a `decode.py --trace` file (nanospec-trace/1; AR in exact mode is the reference).
OTHER holds one {"prompt_ids": [...], "output_ids": [...]} object per line, from any engine (a
full trace works too, and then identical outputs are also checked for bitwise equal logits).
Each OTHER line is matched to the reference line with the same prompt_ids. Per prompt (numbered
by its line in OTHER, from 0), one verdict:

- identical: the same ids wherever both have one, and OTHER is at least as long as the reference
  or stops at an EOS. With two full traces, `bitwise` also says whether every row's sha256 matches.
- near-tie: at the first differing position, the other engine's token b is among the reference
  row's top-k and its gap to the reference token a, logit[a] - logit[b], is within
      tol = ulps * eps(units) * max(1, max |top-k logit|)
  With a calibration (--calibration FILE, or measured by the --engine run itself), units and ulps
  are the engine's measured ones (calibration.py: FACTOR x the largest movement of a top-2 gap
  the engine showed in that setting). Without one, the float rule: eps is the machine epsilon
  (bfloat16 2^-7, float16 2^-10, float32 2^-23) of the coarser of the two engines' dtypes (the
  reference's, and OTHER's "dtype" field or --dtype) and ulps 32 for float32, 8 for bfloat16 and
  float16. `--ulps` overrides either.
- divergence: any larger gap, or b outside the reference's top-k: no rounding explains it.
- short: OTHER agrees with the reference but stops before it without an EOS (an engine that
  gives up early); the position where it stops and the reference's next token are reported.
- empty: OTHER emitted nothing.
- not-bitwise (only with --bitwise, two full traces): identical ids, but some row's sha256
  differs; the first such position and the largest |difference| of the traced values are reported.

With --engine, nanospec runs the engine (nanospec/engines/), compares each setting with the
reference (REFERENCE if given, else traced now) and each speculative setting with the engine's
own greedy output (self-consistency: the same verdicts, judged on the engine's own logits).
--batch B (transformers, llama.cpp) and --concurrency N (a server) ask the batch question the same way: each
prompt decoded inside a batch against the reference, and against the engine's output for that
prompt alone, on the lone run's logits.
The whole-output verdict (forced.py, noise.py, whole.py) judges every run against nanospec's reference as a
whole: nanospec fp32 reads the prompt and the other engine's output teacher-forced and scores every position
(flips, margins, and KL and top-N agreement where the engine returned rows); the run is a divergence when its
flips come too often, too early or at margins the engine's noise explains with negligible probability, or its
distributions sit further from the reference's than the noise's (the four tests' p-values are printed, and
p < whole.ALPHA fails it). The noise is the calibration's (--calibration, or the run's own llama.cpp
calibration), else measured now: nanospec at the engine's dtype against fp32 on the same prompts. A speculative
run is judged the same way against the engine's own plain run, whose scores are its noise. Below it, each
noise's detection floors (floors.py: the weakest planted bug of each class it still flags, from ids and with
rows; --no-floors skips them). With two files, the whole-output verdict needs --weights (the reference's);
without them, with --ulps, and for an engine's batched output against its lone output the per-prompt verdicts
above decide. Exit code 0 only when no run fails: a whole-output divergence (or, without one, a per-prompt
divergence), an empty, short (unless --allow-short) or not-bitwise output (2 on bad input).
"""
import json
from pathlib import Path

from .. import DEFAULT_WEIGHTS, ArgumentParser, NanospecError, cli
from . import calibration as cal
from . import floors, whole
from . import trace as traces
from .calibration import EPS, ULPS, tolerance  # noqa: F401 (the rule's constants, as before)
from .verdict import coarser, compare, summary  # noqa: F401 (coarser: the rule's, as before)
from .verdict import failed as verdict_failed

ENGINES = ["transformers", "llama.cpp", "openai"]


def report(run: dict, ulps: float | None = None) -> None:
    results = run["results"]
    own = run.get("against") in ("greedy", "alone")  # self-consistency: the "reference" is the engine's own output
    mine, theirs = ("alone", "batched") if run.get("against") == "alone" else ("greedy", "speculative")
    for r in results:
        v, head = r["verdict"], f"  prompt {r['prompt']}:"
        if v in ("near-tie", "divergence"):
            gap = "not in the reference's top-k" if r["gap"] is None else f"gap {r['gap']:.4g}"
            print(f"{head} position {r['position']}: {mine if own else 'reference'} {r['reference_token']} (top-2 "
                  f"margin {r['margin']:.4g}), {theirs if own else 'other'} {r['other_token']} ({gap}): {v} "
                  f"(tolerance {r['tolerance']:.3g})")
        elif v == "short":
            print(f"{head} short: stops at position {r['position']} without an EOS; the reference emits "
                  f"{r['reference_next']} there ({r['reference_len']} tokens in all)")
        elif v == "empty":
            print(f"{head} empty: no output ids")
        elif r.get("bitwise") is False:
            print(f"{head} {v}: position {r['position']} is the first row whose sha256 differs; largest "
                  f"|difference| of its traced values {r['max_abs_diff']:.4g}")
    s = summary(results)
    bit = f" ({s['bitwise']} bitwise)" if "bitwise" in s else ""
    u = ulps or run.get("ulps")
    tol = ", ".join(f"{u or ULPS[d]:g} x eps({d})" for d in sorted({r["dtype"] for r in results}))
    how = " (override)" if ulps else f" (calibrated: {run['calibrated']})" if run.get("calibrated") else ""
    more = "".join(f", {s[v]} {v}" for v in ("short", "empty", "not-bitwise") if s[v])
    print(f"{title(run)}: {s['prompts']} prompts: {s['identical']} identical{bit}, {s['near-tie']} near-tie, "
          f"{s['divergence']} divergence{more} (near-tie tolerance: {tol} x logit scale{how})")
    if "whole" in run:
        print(whole.describe(run["whole"]))
        if run["whole"].get("floors"):
            print(floors.describe(run["whole"]["floors"], run["whole"]["noise"]["source"]))
        if whole.caveat(run["whole"]):
            print(whole.caveat(run["whole"]))


def title(run: dict) -> str:
    words = [str(run[k]) for k in ("engine", "setting", "file", "kv", "dtype", "device") if run.get(k)]
    own = {"greedy": ["vs its own greedy"], "alone": ["vs each prompt alone"]}.get(run.get("against"), [])
    return " ".join(words + own)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("reference", nargs="?", help="a decode.py --trace file (with --engine: reused as the reference)")
    p.add_argument("other", nargs="?", help="JSONL of {prompt_ids, output_ids} from the engine under test")
    p.add_argument("--dtype", help="the other engine's dtype (default: its \"dtype\" field, else the reference's); "
                   "with --engine transformers: the dtypes to run, comma-separated", default=None)
    p.add_argument("--ulps", type=float, help="near-tie tolerance in units of eps(dtype) x logit scale, overriding "
                   f"any calibration (float rule: {', '.join(f'{d} {u}' for d, u in ULPS.items())})")
    p.add_argument("--calibration", help="a nanospec-calibration/1 file (--save-calibration): the engine's measured "
                   "tolerance (two trace files: its widest setting)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--engine", choices=ENGINES, help="run this engine here and compare it")
    p.add_argument("--weights", help="--engine: an HF directory, FILE.gguf or hub id org/name (default: the shipped "
                   "model); with two trace files: the reference's weights, for the whole-output test")
    p.add_argument("--prompts", help="--engine: JSONL of {\"prompt\": ...} (default: the weights' prompts.jsonl)")
    p.add_argument("--limit", type=int, help="--engine: only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--settings", help="--engine: the settings to run, comma-separated (default: all; transformers: "
                   "greedy,prompt_lookup,assisted; llama.cpp: greedy,prompt_lookup,draft)")
    p.add_argument("--assistant", help="--engine: the assistant/draft model (directory, .gguf or hub id; default: the "
                   "first --assistant-layers layers of --weights)")
    p.add_argument("--assistant-layers", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=4, help="llama.cpp draft: tokens the draft model proposes")
    p.add_argument("--batch", type=int, default=1, help="--engine transformers, llama.cpp: also decode the prompts B "
                   "at a time (left-padded; llama.cpp: B sequences of one context), judged against the reference "
                   "and against each prompt alone")
    p.add_argument("--concurrency", type=int, default=1, help="--engine openai: also send N requests at once (the "
                   "server batches them), each judged against the reference and against the same prompt sent alone")
    p.add_argument("--kv", default="f16,f32", help="llama.cpp: KV cache types to run (f16 is llama.cpp's default)")
    p.add_argument("--threads", type=int, help="llama.cpp: threads (default: "
                   "llama-cpp-python's, half the cores for single tokens and all of them for batches)")
    p.add_argument("--url", help="--engine openai: the server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--greedy-url", help="--engine openai: the same engine serving without speculation; --url's "
                   "output is also compared with its output (self-consistency)")
    p.add_argument("--model", help="--engine openai: the \"model\" field of each request")
    p.add_argument("--prompt-as", choices=["ids", "text"], default="ids", help="--engine openai: send prompt ids "
                   "(default) or their text (for servers that take no ids; the server's prompt tokens are checked)")
    p.add_argument("--self-only", action="store_true", help="--engine: only each speculative setting against the "
                   "engine's own greedy output (self-consistency): no nanospec reference is traced")
    p.add_argument("--calibrate", action="store_true", help="--engine: measure how far the engine's logits move "
                   "the reference's top-2 gaps (what the near-tie tolerance must cover) instead of comparing outputs")
    p.add_argument("--save-calibration", help="write the measured tolerances to this JSON file (--calibrate, or "
                   "any --engine llama.cpp run without --calibration)")
    p.add_argument("--allow-short", action="store_true", help="an output that stops early (no EOS) does not fail")
    p.add_argument("--bitwise", action="store_true", help="identical ids are not enough: every traced row's "
                   "sha256 must match (both sides full traces)")
    p.add_argument("--save", help="--engine: write the reference and the engine's outputs under this directory")
    p.add_argument("--no-floors", action="store_true", help="skip the detection floors (floors.py: a few planted "
                   "bugs forced through the model per noise model)")
    args = p.parse_args(argv)
    given_weights, args.weights = args.weights, args.weights or str(DEFAULT_WEIGHTS)
    if args.save_calibration and not (args.calibrate or args.engine == "llama.cpp" and not args.calibration):
        raise NanospecError("--save-calibration writes what --calibrate measures (an --engine llama.cpp run measures "
                            "it anyway): add --calibrate")
    if args.save_calibration and not Path(args.save_calibration).resolve().parent.is_dir():
        raise NanospecError(f"--save-calibration {args.save_calibration}: its directory does not exist")
    if args.calibrate and args.calibration:
        raise NanospecError("--calibrate measures a calibration; --calibration uses one: give one of them")
    if args.batch < 1 or args.concurrency < 1:
        raise NanospecError("--batch and --concurrency must be at least 1")
    if args.batch > 1 and args.engine not in ("transformers", "llama.cpp") \
            or args.concurrency > 1 and args.engine != "openai":
        raise NanospecError("--batch runs with --engine transformers or llama.cpp, --concurrency with --engine openai")
    if args.max_new_tokens < 1:
        raise NanospecError("--max-new-tokens must be at least 1")
    if args.engine:
        if args.other:
            raise NanospecError("--engine runs the engine itself: give no OTHER file (REFERENCE is optional)")
        if args.bitwise:
            raise NanospecError("--bitwise compares two full traces (decode.py --trace), not an --engine run")
        if args.self_only and (args.reference or args.calibrate and args.engine != "llama.cpp"):
            raise NanospecError("--self-only uses no reference: give no REFERENCE, and --calibrate needs the "
                                "reference (llama.cpp's `self` calibration aside)")
        from . import engines
        runs = engines.run(args.engine, args)
    else:
        if not (args.reference and args.other):
            raise NanospecError("give REFERENCE.jsonl and OTHER.jsonl, or --engine " + "|".join(ENGINES))
        if args.calibrate:
            raise NanospecError("--calibrate runs an engine: add --engine")
        refs, extra = traces.read(args.reference, full=True), {}
        if args.calibration:
            c = cal.read(args.calibration)
            if c.get("model") not in (None, refs[0].get("model")) and refs[0].get("model"):
                raise NanospecError(f"{args.calibration} calibrates other weights than the reference traces")
            e = cal.widest(c)
            extra = {"units": e["units"], "ulps": e["ulps"], "calibrated": f"{args.calibration}, widest setting"}
        others = traces.read(args.other)
        runs = [{"engine": args.other, "dtype": args.dtype, **extra,
                 "results": compare(refs, others, args.dtype, args.ulps or extra.get("ulps"), args.bitwise,
                                    extra.get("units"))}]
        if given_weights:  # the whole-output test needs the reference's weights to force the other's tokens
            runs[0].update(files_whole(args, refs, others))
    verdicts = [r for r in runs if "results" in r]  # the rest: calibration and tokenizer records
    for r in verdicts:
        r["summary"] = summary(r["results"])
        report(r, args.ulps)
    if args.json:
        print(json.dumps({"ulps": args.ulps, "runs": runs}))
    return 1 if any(failed(r, args.allow_short) for r in verdicts) else 0


def failed(run: dict, allow_short: bool = False) -> bool:
    """A run with a whole-output verdict fails on it (and on an empty, short or not-bitwise output); one
    without (self-consistency, --ulps, two files without --weights), on any per-prompt failure."""
    s = run["summary"]
    if "whole" not in run:
        return verdict_failed(s, allow_short)
    return run["whole"]["verdict"] == "divergence" or verdict_failed({**s, "divergence": 0}, allow_short)


def files_whole(args, refs: list[dict], others: list[dict]) -> dict:
    """Two trace files with --weights: the whole-output test, against the calibration's noise (--calibration)
    or nanospec's at the other's dtype (--dtype, its "dtype" field, else float32) measured now."""
    from ..io.checkpoint import load
    from ..io.files import fingerprint
    from ..io.sources import base_of, resolve
    from .engines import Whole
    if args.ulps is not None:
        return {}
    weights = resolve(args.weights)
    fp32 = load(base_of(weights))
    if refs[0].get("model") not in (None, fingerprint(fp32)):
        raise NanospecError(f"--weights {args.weights} are not the weights the reference traces")
    judge = Whole(args, weights, fp32)
    if args.calibration:
        c = cal.read(args.calibration)
        dtype, entries, source = "float32", list(c["settings"].values()), f"{Path(args.calibration).name}"
    else:
        dtype = coarser(args.dtype, *(o.get("dtype") for o in others)) if args.dtype or any(
            o.get("dtype") for o in others) else "float32"
        entries, source = None, ""
    return judge.of(refs, others, dtype, calibrated=entries, source=source)


if __name__ == "__main__":
    cli(main)
