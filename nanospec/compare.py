"""Check another engine's greedy output against nanospec's reference trace.

    python -m nanospec.compare REFERENCE.jsonl OTHER.jsonl [--dtype bfloat16] [--json]
    python -m nanospec.compare --engine transformers [--weights DIR] [--dtype float32,bfloat16]

REFERENCE is a `decode.py --trace` file (nanospec-trace/1; AR in exact mode is the reference).
OTHER holds one {"prompt_ids": [...], "output_ids": [...]} object per line, from any engine (a
full trace works too, and then identical outputs are also checked for bitwise equal logits).
Each OTHER line is matched to the reference line with the same prompt_ids. Per prompt (numbered
by its line in OTHER, from 0), one verdict:

- identical: the same ids wherever both have one, and OTHER is at least as long as the reference
  or stops at an EOS. With two full traces, `bitwise` also says whether every row's sha256 matches.
- near-tie: at the first differing position, the other engine's token b is among the reference
  row's top-k and its gap to the reference token a, logit[a] - logit[b], is within
      tol = ulps * eps(dtype) * max(1, max |top-k logit|)
  where eps is the dtype's machine epsilon (bfloat16 2^-7, float16 2^-10, float32 2^-23), dtype
  the coarser of the two engines' (the reference's, and OTHER's "dtype" field or --dtype) and
  ulps 32 for float32, 8 for bfloat16 and float16 (`--ulps` overrides). `--engine transformers
  --calibrate` measures what they must cover: how far another engine's forward moves the
  reference's top-2 gaps, in these units (README: at most a few units on the default model).
- divergence: any larger gap, or b outside the reference's top-k: no rounding explains it.
- short: OTHER agrees with the reference but stops before it without an EOS (an engine that
  gives up early); the position where it stops and the reference's next token are reported.
- empty: OTHER emitted nothing.
- not-bitwise (only with --bitwise, two full traces): identical ids, but some row's sha256
  differs; the first such position and the largest |difference| of the traced values are reported.

Exit code 0 only when no prompt fails: divergence, empty, short (unless --allow-short) and
not-bitwise fail (2 on bad input).
"""
import json
import sys
import time
from pathlib import Path

import torch

from . import ArgumentParser, NanospecError, cli
from . import trace as traces
from .bench import load_prompts
from .peers import hf_generate
from .checkpoint import DTYPES, fingerprint, load, load_args
from .engine import generate
from .sources import resolve
from .tokenizer import load_tokenizer

EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
ULPS = {"float32": 32, "bfloat16": 8, "float16": 8}  # calibrated: see the module docstring
SETTINGS = {"greedy": "plain greedy", "prompt_lookup": "prompt lookup (prompt_lookup_num_tokens=10)",
            "assisted": "assisted generation (assistant_model)"}


def coarser(*dtypes) -> str:
    known = [d for d in dtypes if d]
    for d in known:
        if d not in EPS:
            raise NanospecError(f"unknown dtype {d!r}: one of {', '.join(EPS)}")
    return max(known, key=EPS.get)


def tolerance(pos: dict, dtype: str, ulps: float | None = None) -> float:
    return (ulps or ULPS[dtype]) * EPS[dtype] * max(1.0, *(abs(v) for v in pos["top_logits"]))


def compare_one(ref: dict, other: dict, dtype: str, ulps: float | None = None, bitwise: bool = False) -> dict:
    """One prompt's verdict (see the module docstring)."""
    a_ids, b_ids = ref["output_ids"], other["output_ids"]
    n = min(len(a_ids), len(b_ids))
    res = {"compared": n, "reference_len": len(a_ids), "other_len": len(b_ids)}
    if not b_ids:
        return {**res, "verdict": "empty"}
    i = next((i for i in range(n) if a_ids[i] != b_ids[i]), None)
    if i is None:
        eos = other.get("eos_id", ref.get("eos_id"))
        if len(b_ids) < len(a_ids) and b_ids[-1] != eos:
            return {**res, "verdict": "short", "position": len(b_ids), "reference_next": a_ids[len(b_ids)]}
        res["verdict"] = "identical"
        if "positions" in other:
            rows = list(zip(ref["positions"][:n], other["positions"]))
            j = next((j for j, (p, q) in enumerate(rows) if p["sha256"] != q.get("sha256")), None)
            res["bitwise"] = j is None
            if j is not None:
                res.update(position=j, max_abs_diff=traced_difference(*rows[j]))
                if bitwise:
                    res["verdict"] = "not-bitwise"
        return res
    pos, a, b = ref["positions"][i], a_ids[i], b_ids[i]
    top = dict(zip(pos["top_ids"], pos["top_logits"]))
    tol = tolerance(pos, dtype, ulps)
    gap = top[a] - top[b] if a in top and b in top else None
    res.update(position=i, reference_token=a, other_token=b, margin=pos["top_logits"][0] - pos["top_logits"][1],
               gap=gap, tolerance=tol, verdict="near-tie" if gap is not None and gap <= tol else "divergence")
    return res


def traced_difference(p: dict, q: dict) -> float:
    """The largest |difference| between two positions' traced values: the logits of the ids both
    list in their top-k, and the log-sum-exp."""
    a, b = dict(zip(p["top_ids"], p["top_logits"])), dict(zip(q.get("top_ids", []), q.get("top_logits", [])))
    diffs = [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    if "lse" in q:
        diffs.append(abs(p["lse"] - q["lse"]))
    return max(diffs, default=float("nan"))


def compare(refs: list[dict], others: list[dict], dtype: str | None = None, ulps: float | None = None,
            bitwise: bool = False) -> list[dict]:
    index = {tuple(r["prompt_ids"]): r for r in refs}
    fps = {r.get("model") for r in refs} | {o.get("model") for o in others}
    if len(fps - {None}) > 1:
        raise NanospecError("the two traces come from different weights (their \"model\" fingerprints differ)")
    if bitwise and not all("positions" in o for o in others):
        raise NanospecError("--bitwise needs a full trace (decode.py --trace) on both sides")
    results = []
    for k, o in enumerate(others):
        ref = index.get(tuple(o["prompt_ids"]))
        if ref is None:
            raise NanospecError(f"line {k + 1} of the other output has prompt_ids that the reference does not "
                                "trace: trace the same prompts with decode.py --trace")
        if ref.get("temperature", 0.0):
            raise NanospecError("the reference was sampled (temperature > 0): compare needs a greedy trace")
        d = coarser(ref.get("dtype", "float32"), o.get("dtype"), dtype)
        results.append({"prompt": k, "dtype": d, **compare_one(ref, o, d, ulps, bitwise)})
    return results


VERDICTS = ("identical", "near-tie", "divergence", "short", "empty", "not-bitwise")


def summary(results: list[dict]) -> dict:
    count = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
    bitwise = [r["bitwise"] for r in results if "bitwise" in r]
    return {"prompts": len(results), **count, **({"bitwise": sum(bitwise)} if bitwise else {})}


def failed(s: dict, allow_short: bool = False) -> bool:
    """Whether a run's summary fails it: a divergence, an empty output, a short one (unless
    allowed) or, under --bitwise, a row that differs in any bit."""
    return bool(s["divergence"] or s["empty"] or s["not-bitwise"] or (s["short"] and not allow_short))


def report(results: list[dict], title: str, ulps: float | None) -> None:
    for r in results:
        v, head = r["verdict"], f"  prompt {r['prompt']}:"
        if v in ("near-tie", "divergence"):
            gap = "not in the reference's top-k" if r["gap"] is None else f"gap {r['gap']:.4g}"
            print(f"{head} position {r['position']}: reference {r['reference_token']} (top-2 margin {r['margin']:.4g}), "
                  f"other {r['other_token']} ({gap}): {v} (tolerance {r['tolerance']:.3g})")
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
    tol = ", ".join(f"{ulps or ULPS[d]:g} x eps({d})" for d in sorted({r["dtype"] for r in results}))
    more = "".join(f", {s[v]} {v}" for v in ("short", "empty", "not-bitwise") if s[v])
    print(f"{title}: {s['prompts']} prompts: {s['identical']} identical{bit}, {s['near-tie']} near-tie, "
          f"{s['divergence']} divergence{more} (near-tie tolerance: {tol} x logit scale)")


def progress(tag: str, i: int, n: int, t0: float) -> None:
    left = (time.perf_counter() - t0) / (i + 1) * (n - i - 1)
    print(f"[{tag}] prompt {i + 1}/{n}, {left:.0f}s left", file=sys.stderr, flush=True)


def hf_outputs(hf, prompts, setting, max_new_tokens, eos_id, assistant=None):
    """transformers' LlamaForCausalLM.generate, greedy, in one of SETTINGS."""
    outs, t0 = [], time.perf_counter()
    for k, p in enumerate(prompts):
        outs.append({"prompt_ids": p, "output_ids": hf_generate(hf, p, setting, max_new_tokens, eos_id, assistant),
                     "dtype": str(hf.dtype).removeprefix("torch."), "eos_id": eos_id})
        progress(f"transformers {setting}", k, len(prompts), t0)
    return outs


def reference(model, prompts, max_new_tokens, k=8) -> list[dict]:
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


def gap_shifts(hf, prompt, tokens, logits, dtype) -> torch.Tensor:
    """How far hf's forward over prompt + tokens moves each reference row's top-2 gap, in units of
    eps(dtype) x the row's logit scale (the units of the near-tie tolerance)."""
    seq = torch.tensor([prompt + tokens], device=hf.device)
    with torch.no_grad():
        other = hf(seq).logits[0, len(prompt) - 1:-1].float().cpu()
    top = logits.topk(8, -1)
    a, b = top.indices[:, :1], top.indices[:, 1:2]
    gap = lambda rows: (rows.gather(1, a) - rows.gather(1, b))[:, 0]
    return (gap(logits) - gap(other)).abs() / (EPS[dtype] * top.values.abs().amax(-1).clamp(min=1))


def calibrate(model, hf, prompts, max_new_tokens, dtype) -> dict:
    """The measurement behind ULPS: transformers' logits against nanospec's exact AR rows."""
    shifts, t0 = [], time.perf_counter()
    for i, p in enumerate(prompts):
        out = generate(model, p, max_new_tokens=max_new_tokens, exact=True, record_logits=True)
        shifts.append(gap_shifts(hf, p, out.tokens, out.logits, dtype))
        progress("calibration", i, len(prompts), t0)
    shifts = torch.cat(shifts)
    return {"positions": len(shifts), "max": round(float(shifts.max()), 3),
            "p99.9": round(float(shifts.quantile(0.999)), 3), "median": round(float(shifts.median()), 3)}


def run_transformers(args) -> list[dict]:
    """Every (dtype, setting): nanospec's exact AR trace vs transformers' generate on the same weights."""
    try:
        import transformers
    except ImportError:
        raise NanospecError("--engine transformers needs transformers: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    weights = resolve(args.weights, log=sys.stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise NanospecError("--device cuda: no CUDA device is available; use --device cpu")
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            raise NanospecError(f"unknown setting {s!r}: one of {', '.join(SETTINGS)}")
    if args.assistant:
        args.assistant = resolve(args.assistant, log=sys.stderr)
    if args.assistant and "assisted" in settings and load_args(args.assistant).vocab_size != load_args(weights).vocab_size:
        raise NanospecError(f"the assistant at {args.assistant} has another vocabulary than {weights}: "
                            "assisted generation needs the same tokenizer")
    prompt_file = Path(args.prompts) if args.prompts else weights / "prompts.jsonl"
    tok = load_tokenizer(weights)
    if tok is None:
        raise NanospecError(f"{weights} has no tokenizer.json or tokenizer.model to encode the prompts with")
    prompts = [tok.encode(t) for t in load_prompts(prompt_file)[:args.limit]]
    runs = []
    for name in args.dtype.split(","):
        if name not in DTYPES:
            raise NanospecError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
        model = load(weights, DTYPES[name], args.device)
        hf = transformers.LlamaForCausalLM.from_pretrained(weights, dtype=DTYPES[name]).to(args.device).eval()
        if args.calibrate:  # transformers in this dtype against nanospec in it, and against fp32 nanospec
            for ref in [model] + ([load(weights, torch.float32, args.device)] if name != "float32" else []):
                units = coarser(name, str(ref.embed.weight.dtype).removeprefix("torch."))
                runs.append({"engine": "transformers", "setting": "calibration", "dtype": name, "device": args.device,
                             "reference_dtype": str(ref.embed.weight.dtype).removeprefix("torch."), "units": units,
                             **calibrate(ref, hf, prompts, args.max_new_tokens, units)})
                r = runs[-1]
                print(f"calibration: transformers {name} vs nanospec exact AR {r['reference_dtype']}: top-2 gaps move "
                      f"by at most {r['max']} (p99.9 {r['p99.9']}, median {r['median']}) x eps({units}) x logit "
                      f"scale over {r['positions']} positions; the near-tie tolerance is {ULPS[units]}")
            continue
        refs = reference(model, prompts, args.max_new_tokens)
        assistant = None
        if "assisted" in settings:
            src = Path(args.assistant) if args.assistant else weights
            kw = {} if args.assistant else {"num_hidden_layers": args.assistant_layers}
            assistant = transformers.LlamaForCausalLM.from_pretrained(src, dtype=DTYPES[name], **kw).to(args.device).eval()
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            traces.write(Path(args.save) / f"nanospec-ar-{name}.jsonl", refs)
        for s in settings:
            others = hf_outputs(hf, prompts, s, args.max_new_tokens, model.args.eos_id, assistant)
            if args.save:
                traces.write(Path(args.save) / f"transformers-{s}-{name}.jsonl", others)
            runs.append({"engine": "transformers", "setting": s, "dtype": name, "device": args.device,
                         "results": compare(refs, others, ulps=args.ulps)})  # not full traces: no --bitwise
    return runs


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("reference", nargs="?", help="a decode.py --trace file")
    p.add_argument("other", nargs="?", help="JSONL of {prompt_ids, output_ids} from the engine under test")
    p.add_argument("--dtype", help="the other engine's dtype (default: its \"dtype\" field, else the reference's); "
                   "with --engine: the dtypes to run, comma-separated", default=None)
    p.add_argument("--ulps", type=float, help="near-tie tolerance in units of eps(dtype) x logit scale "
                   f"(default: {', '.join(f'{d} {u}' for d, u in ULPS.items())})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--engine", choices=["transformers"], help="run this engine here and compare it")
    p.add_argument("--weights", default=str(Path(__file__).parents[1] / "weights" / "pylm"),
                   help="--engine: an HF Llama directory, FILE.gguf or hub id org/name (default: the shipped model)")
    p.add_argument("--prompts", help="--engine: JSONL of {\"prompt\": ...} (default: the weights' prompts.jsonl)")
    p.add_argument("--limit", type=int, help="--engine: only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"--engine: some of {', '.join(SETTINGS)}")
    p.add_argument("--assistant", help="--engine: the assistant model (directory, .gguf or hub id; default: the first "
                   "--assistant-layers layers of --weights)")
    p.add_argument("--assistant-layers", type=int, default=2)
    p.add_argument("--calibrate", action="store_true", help="--engine: measure how far the engine's logits move "
                   "the reference's top-2 gaps (what the near-tie tolerance must cover) instead of comparing outputs")
    p.add_argument("--allow-short", action="store_true", help="an output that stops early (no EOS) does not fail")
    p.add_argument("--bitwise", action="store_true", help="identical ids are not enough: every traced row's "
                   "sha256 must match (both sides full traces)")
    p.add_argument("--save", help="--engine: write the reference and the engine's outputs under this directory")
    args = p.parse_args(argv)
    if args.engine:
        if args.reference or args.other:
            raise NanospecError("--engine runs the engine itself: give no trace files")
        if args.bitwise:
            raise NanospecError("--bitwise compares two full traces (decode.py --trace), not an --engine run")
        args.dtype = args.dtype or "float32,bfloat16"
        runs = run_transformers(args)
    else:
        if not (args.reference and args.other):
            raise NanospecError("give REFERENCE.jsonl and OTHER.jsonl, or --engine transformers")
        runs = [{"engine": args.other, "dtype": args.dtype,
                 "results": compare(traces.read(args.reference, full=True), traces.read(args.other), args.dtype,
                                    args.ulps, args.bitwise)}]
    if args.engine and args.calibrate:
        if args.json:
            print(json.dumps({"runs": runs}))
        return 0
    for r in runs:
        r["summary"] = summary(r["results"])
        title = " ".join(str(r[k]) for k in ("engine", "setting", "dtype", "device") if r.get(k))
        report(r["results"], title, args.ulps)
    if args.json:
        print(json.dumps({"ulps": args.ulps, "runs": runs}))
    return 1 if any(failed(r["summary"], args.allow_short) for r in runs) else 0


if __name__ == "__main__":
    cli(main)
