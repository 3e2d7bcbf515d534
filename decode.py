"""Decode with a method, check it against AR, or benchmark methods.

    python decode.py --method hidden_transfer --prompt "def fibonacci(n):"
    python decode.py --method ar --prompt "def fibonacci(n):"
    python decode.py --method ar --weights DIR --check --json
    python decode.py --weights FILE.gguf --chat --prompt "Write a haiku about caches."
    python decode.py --method medusa --show 3        # draw the first 3 steps' draft trees
    python decode.py --method propd --show-html steps.html   # every step as one HTML page
    python decode.py --bench --methods ar            # the default model's held-out prompts
    python decode.py --bench --methods ar,medusa --batch 1,4 --plot bench.png   # pip install -e ".[plot]"
"""
import copy
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from nanospec import DEFAULT_WEIGHTS, ArgumentParser, NanospecError, check_device, cli, compiled, devices, plot
from nanospec.bench import bench, first_difference, load_prompts, same_as_ar, table
from nanospec.devices import Device
from nanospec.engine import AR, check_prompt, check_room, generate, shapes
from nanospec.io import chat
from nanospec.io.checkpoint import DTYPES, load
from nanospec.io.files import atomic_write, fingerprint
from nanospec.io.sources import base_of, resolve
from nanospec.io.tokenizer import load_tokenizer
from nanospec.methods import METHODS, check_method, drafters_for, load_drafter, model_dir, split_specs
from nanospec.oracle import trace
from nanospec.oracle.peers import transformers_peers
from nanospec.show import Show
from nanospec.sizes import block_batch
from nanospec.tuning import products
from nanospec.tuning.counts import step_counts
from nanospec.tuning.measured import measure as measure_costs
from nanospec.tuning.probing import Probing, own_budgets


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--method", default="ar", help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text (no BOS added)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default=None, help="HF directory (llama, mistral, qwen2, qwen3), FILE.gguf (converted "
                   "once, cached) or a hub id org/name "
                   f"(default: {DEFAULT_WEIGHTS.relative_to(Path(__file__).resolve().parent)})")
    p.add_argument("--drafters", help="the directory of the method's trained weights (default: the --weights "
                   "directory, else the shipped one trained for this model's fingerprint)")
    p.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template as one user "
                   "message, and stop at the template's end-of-turn token")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--mode", choices=["exact", "fast"],
                   help="default: fast on cpu; exact on cuda (CUDA graphs), where bf16 fast mode can flip near-ties")
    p.add_argument("--block", type=int, help="exact mode: rows per forward (Q)")
    p.add_argument("--block-batch", type=int, help="exact mode: every forward runs this many sequences' blocks of Q "
                   "rows, idle ones padded, so a product's total rows never depend on the batch (default: a "
                   "multiple of 8 on cuda, where cuBLAS picks its fp32 kernel by them; none on cpu)")
    p.add_argument("--compile", action="store_true", help="exact mode: each layer one torch.compile'd callable, AR's "
                   "and every method's (a new shape compiles once; opt-in: not yet verified on a GPU)")
    p.add_argument("--max-len", type=int, help="KV cache slots (S); default fits prompt + new tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="also run AR and compare tokens (and logits in exact mode); the speeds printed beside are "
                        "one warm run of each (--bench measures)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--bench", action="store_true", help="benchmark --methods over --prompts")
    p.add_argument("--prompts", help="JSONL file of {\"prompt\": ...}: decode each, or --bench them "
                   "(--bench default: the weights' prompts.jsonl)")
    p.add_argument("--limit", type=int, help="only the first N of --prompts")
    p.add_argument("--methods", default="ar", help="comma-separated methods for --bench (all: every one that decodes "
                   "the base model)")
    p.add_argument("--costs", action="store_true", help="--bench: also count what each method's exact step costs a "
                   "GPU (ops per layer, MB written, launches, syncs: minutes on a CPU; always on --device cuda)")
    p.add_argument("--batch", default="1", help="sequences decoded together: --prompts B at a time; --bench: "
                   "comma-separated batch sizes, e.g. 1,2,4,8 (speedups against AR at the same size)")
    p.add_argument("--profile", action="store_true", help="--bench: also print each method's top host-side costs, "
                   "and per live batch size its planner's expected and realized tokens/s for AR steps and drafts")
    p.add_argument("--peers", choices=["transformers"], help="--bench: also time transformers' greedy, prompt lookup "
                   "and assisted generation on the same prompts, interleaved with the methods")
    p.add_argument("--kernels", choices=["tuned", "eager"], default="tuned",
                   help="fast mode's product forms: each matrix product's form fastest for its row count on this "
                   "machine (timed once, cached), or always F.linear")
    p.add_argument("--planner", choices=["measured", "none"], default="measured",
                   help="measured (fast mode): the core planner sizes each step's tree (0: an AR step) from what a "
                   "row costs on this machine (measured once, cached) and how the method's drafts fare; none: "
                   "each method's own tree (propd:planner=online: ProPD plans its own, on its paper's online cost "
                   "line)")
    p.add_argument("--budget", type=int, metavar="N", help="fast mode: every step of every method drafts N nodes, "
                   "the core planner's tree of that size, never planned (0: every step an AR step, the method's "
                   "own bookkeeping still run); what a budget buys, to set beside --planner measured")
    p.add_argument("--trace", help="write FILE.jsonl (nanospec-trace/1): per prompt the emitted ids and, per "
                   "position, its logit row's top-k, log-sum-exp and sha256 (the reference: --method ar --mode exact)")
    p.add_argument("--trace-k", type=int, default=8, help="top-k logits per position in --trace")
    p.add_argument("--show", nargs="?", type=int, const=math.inf, metavar="N", help="print each step (the first N) "
                   "to stderr as the tree it verified, the accepted path marked, and its bonus token (greedy only)")
    p.add_argument("--plot", metavar="FILE.png", help="--bench: draw the table (speedup and tokens per step per "
                   "method; with several --batch sizes, speedup against batch size) into a PNG (pip install -e "
                   "\".[plot]\")")
    p.add_argument("--show-html", metavar="FILE", help="write the steps --show draws (every one, or its first N) "
                   "as one self-contained HTML page, a tree per step (greedy only)")
    return p.parse_args(argv)


def setup(args):
    check_device(args.device)
    if not args.weights and not DEFAULT_WEIGHTS.is_dir():
        raise NanospecError(f"the default model ({DEFAULT_WEIGHTS}) is not in this checkout yet; "
                            "pass --weights DIR with an HF checkpoint")
    if args.chat and args.prompt_ids is not None:
        raise NanospecError("--chat renders text: give --prompt, not --prompt-ids")
    if args.trace and args.bench:
        raise NanospecError("--trace records decoding, not --bench: use --prompts FILE.jsonl --trace OUT.jsonl")
    for flag, out in (("--trace", args.trace), ("--plot", args.plot), ("--show-html", args.show_html)):
        if out and not Path(out).resolve().parent.is_dir():
            raise NanospecError(f"{flag} {out}: its directory does not exist")
    if (args.show is not None or args.show_html) and (args.bench or args.temperature > 0):
        raise NanospecError("--show draws a greedy decoding's steps: not with --bench or --temperature > 0")
    if args.plot and not args.bench:
        raise NanospecError("--plot draws a bench's table: use it with --bench")
    if args.plot:
        plot.check()
    if args.show is not None and args.show < 1:
        raise NanospecError("--show N draws the first N steps: N must be at least 1")
    if args.trace_k < 2:
        raise NanospecError("--trace-k must be at least 2 (compare reads the top-2 margin)")
    if args.budget is not None and (args.budget < 0 or args.planner == "none"):
        raise NanospecError("--budget N plans N >= 0 draft nodes a step: not with --planner none")
    if args.max_new_tokens < 1:
        raise NanospecError("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise NanospecError("sampling needs --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    weights = resolve(args.weights or DEFAULT_WEIGHTS, log=sys.stderr)
    own = model_dir(split_specs(args.methods) if args.bench else [args.method], weights)
    base = base_of(own)  # the model's files (weights/smollm2 ships drafters only: base.json names its model)
    tok = load_tokenizer(base)
    args.weights_dir, args.eos_id = base, None
    if args.chat:  # the template is checked before the weights are loaded
        if tok is None:
            raise NanospecError(f"--chat needs a tokenizer: {base} has no tokenizer.json or tokenizer.model")
        args.eos_id = chat.end_of_turn(tok, chat.template(base))
    model = load(base, dtype, args.device)
    return drafters_for(model, own, args.drafters), model, dtype, tok, own != weights


def note_own_model(weights) -> None:
    print(f"note: decoding {weights}, the method's fine-tuned model; AR (--check, --bench) runs on it too",
          file=sys.stderr)


def tune(args, model, exact: bool, drafters) -> Device:
    """The device's layout and speed every generation of the run gets (devices.py). Exact mode keeps one kernel and
    static trees: its block is fixed; --compile makes its layer one compiled callable (compiled.py). Fast mode: on a
    CPU, --kernels tuned gives the model's products each its fastest form by row count (tuning/products.py);
    --planner measured hands every drafter without a planner of its own the core planner with a CPU's additions, on
    this machine's measured row costs (a drafter it can plan: ranked, or nested), and a method's own planner gets
    the budgets that fill the row buckets; --budget N hands every drafter it can plan one of a single budget, N."""
    dev = devices.of(model.embed.weight)  # the device the weights are on
    if exact and args.budget is not None:
        raise NanospecError("--budget N plans fast mode's steps: exact mode runs each method's own tree (--mode fast)")
    if exact:
        return replace(dev, call=compiled.layer) if args.compile else dev
    if args.kernels == "tuned" and args.device == "cpu":
        dev = replace(dev, forms=products.tuned(model, *drafters))  # the drafters' products too
    for d in drafters:
        if args.budget is not None and (d.topk or d.nested):  # one budget: every step's
            d.plan(Probing(measure_costs(model, dev=dev), budgets=(args.budget,)))
        elif d.planner is not None:
            own_budgets(d)
        elif args.planner == "measured" and (d.topk or d.nested):
            d.plan(Probing(measure_costs(model, dev=dev)))
    return dev


def read_text(path) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else e
        raise NanospecError(f"cannot read the prompt file {path}: {why}") from None


def encode(args, tok, text):
    if args.prompt_ids is not None:
        if not args.prompt_ids.strip():
            raise NanospecError("--prompt-ids is empty: give at least one token id")
        try:
            return [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise NanospecError("--prompt-ids takes comma-separated integers, e.g. 1,450,3") from None
    if tok is None:
        raise NanospecError("this weights directory has no tokenizer.json or tokenizer.model: pass --prompt-ids")
    if args.chat:
        return chat.prompt_ids(args.weights_dir, tok, text)[0]
    return tok.encode(text)


def main(argv=None):
    args = parse_args(argv)
    methods = split_specs(args.methods) if args.bench else [args.method]
    for m in methods:  # before loading any weights
        check_method(m)
    batches = parse_batches(args.batch)
    if not args.bench and len(batches) > 1:
        raise NanospecError("--batch takes one size when decoding (several only with --bench)")
    if args.peers and batches != [1]:
        raise NanospecError("--peers times transformers one prompt at a time: use it with --batch 1")
    args.mode = args.mode or ("exact" if args.device == "cuda" else "fast")
    exact = args.mode == "exact"
    if args.block_batch is not None:  # before any weights are loaded (the batch it must hold: generate checks)
        block_batch(args.block_batch, 1, exact, args.device)
    if args.compile and not exact:
        raise NanospecError("--compile compiles exact mode's fixed shapes: add --mode exact")
    weights, model, dtype, tok, own_model = setup(args)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    info = dict(mode=args.mode, device=args.device, dtype=str(dtype).removeprefix("torch."))

    if args.bench:
        # the drafters' directory's prompts, else the --weights directory's (--drafters may hold drafters only)
        found = [d / "prompts.jsonl" for d in (weights, Path(args.weights or DEFAULT_WEIGHTS))
                 if (d / "prompts.jsonl").is_file()]
        prompt_file = args.prompts or (found[0] if found else None)
        if prompt_file is None:
            raise NanospecError("--bench needs --prompts FILE.jsonl (neither the weights' nor the drafters' directory "
                                "has a prompts.jsonl)")
        prompts = [encode(args, tok, p) for p in load_prompts(prompt_file)[:args.limit]]
        drafters = [load_drafter(m, model, weights) for m in methods]
        if own_model:
            note_own_model(weights)
        counts = {B: {} for B in batches}
        if args.costs or args.device == "cuda":
            print("[bench] counting what each method's exact step costs a GPU (a small cache, before any tuning)",
                  file=sys.stderr, flush=True)
            counts = {B: {m: step_counts(model, lambda there, m=m: load_drafter(m, there, weights), d, B, args.compile)
                          for m, d in zip(methods, drafters)} for B in batches}
        dev = tune(args, model, exact, drafters)
        peers = transformers_peers(weights, dtype, args.device) if args.peers else ()
        results = []
        for B in batches:  # each size with fresh drafters: a trie or a planner learns nothing from another size's run
            fresh = copy.deepcopy(drafters) if len(batches) > 1 else drafters
            results += bench(model, prompts, fresh, exact=exact, max_new_tokens=args.max_new_tokens, eos_id=args.eos_id,
                             sampling=sampling, profile=args.profile, peers=peers, batch=B,
                             block_batch=args.block_batch, dev=dev,
                             counts={d.name: counts[B].get(m, {}) for m, d in zip(methods, fresh)})
            print(table([r for r in results if r["batch"] == B]), flush=True)
        if args.plot:
            title = f"{Path(args.weights or DEFAULT_WEIGHTS).name}, {args.mode} mode, {info['dtype']}, {args.device}"
            atomic_write(Path(args.plot), lambda tmp: plot.plot(results, tmp, title))
        if args.compile:
            info["compile_s"] = report_compiles()
        if args.json:
            print(json.dumps({**info, "max_new_tokens": args.max_new_tokens, "results": results}))
        return 0

    drafter = load_drafter(args.method, model, weights)
    if own_model:
        note_own_model(weights)
    if args.prompts:  # several prompts in turn (one drafter: a method's state persists across them)
        texts = load_prompts(args.prompts)[:args.limit]
    else:
        texts = [read_text(args.prompt_file) if args.prompt_file else args.prompt]
    entries = []
    meta = dict(method=args.method, **info, model=fingerprint(model), eos_id=model.args.eos_id, **sampling) \
        if args.trace else None
    prompts = [encode(args, tok, text) for text in texts]
    for prompt in prompts:  # bad input ends here, before any tuning
        check_prompt(prompt, model.args.vocab_size)
        S = shapes([drafter, AR], len(prompt), args.max_new_tokens, args.block, args.max_len)[1]
        check_room(len(prompt), S - 1 - drafter.reserved_slots)
    dev = tune(args, model, exact, [drafter])
    status = decode_batch(args, model, tok, drafter, texts, prompts, batches[0], info, exact, sampling, meta, entries,
                          dev)
    if args.trace:
        trace.write(args.trace, entries)
        print(f"wrote {args.trace}: {len(entries)} prompt(s), format {trace.FORMAT}", file=sys.stderr)
    if args.compile:
        report_compiles()
    return status


def report_compiles() -> list[float]:
    """--compile's cost: seconds of each call that compiled a new shape (printed; returned for the JSON)."""
    secs = [round(s, 2) for s in compiled.compiles]
    print(f"[compile] {len(secs)} new shapes compiled, {sum(secs):.1f} s in all: {secs}", file=sys.stderr)
    return secs


def parse_batches(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise NanospecError(f"--batch {text!r}: give positive sizes, e.g. 4 or 1,2,4,8")
    return sizes


def decode_batch(args, model, tok, drafter, texts, prompts, B, info, exact, sampling, meta, entries, dev) -> int:
    """Prompts decoded B at a time, a stopped one's row taking the next prompt (each output as if
    decoded alone), printed in turn."""
    Q, S, W = shapes([drafter, AR], max(map(len, prompts)), args.max_new_tokens, args.block, args.max_len)
    kw = dict(max_new_tokens=args.max_new_tokens, exact=exact, Q=Q, n_slots=S, tail=W, eos_id=args.eos_id,
              record_logits=args.check or meta is not None, block_batch=args.block_batch, dev=dev, **sampling)
    if args.check and args.method != "ar":
        # --check compares warm speeds: a first call allocates, picks kernels and captures graphs. The method and AR
        # each run once untimed first, the method as a copy, so its state (a trie, a planner) learns nothing there
        warm = dict(kw, max_new_tokens=min(8, args.max_new_tokens))
        generate(model, prompts[:B], copy.deepcopy(drafter), batch=B, **warm)
        generate(model, prompts[0], AR, **warm)
    show = None
    if args.show is not None or args.show_html:
        show = Show(lambda i: repr(tok.decode([i])) if tok else str(i), drafter, args.show or math.inf,
                    sys.stderr if args.show is not None else None, keep=bool(args.show_html))
    t = time.perf_counter()
    outs = generate(model, prompts, drafter, batch=B, on_step=show, **kw)
    seconds = time.perf_counter() - t - outs[0].prefill_s
    if args.show_html:
        page = show.page(f"nanospec: {args.method}'s steps ({'exact' if exact else 'fast'} mode)")
        atomic_write(Path(args.show_html), lambda tmp: tmp.write_text(page, encoding="utf-8"))
    refs = [generate(model, p, AR, **kw) for p in prompts] if args.check else [None] * len(prompts)
    if len(prompts) > 1:
        new = sum(len(o.tokens) for o in outs)
        print(f"[{args.method}] {len(prompts)} prompts, {min(B, len(prompts))} at a time: {new} tokens in "
              f"{seconds:.2f}s "
              f"({new / seconds:.1f} tok/s together)", file=sys.stderr)
    status = 0
    for i, (text, prompt, out, ref) in enumerate(zip(texts, prompts, outs, refs)):
        if i:
            print("-" * 72)
        status = max(status, report_one(args, tok, text, prompt, out, ref, S, info, exact, meta, entries))
    return status


def report_one(args, tok, text, prompt, out, ref, S, info, exact, meta, entries) -> int:
    if meta is not None:
        entries.append(trace.record(prompt, out.tokens, out.logits, args.trace_k, **meta))
    new_text = tok.decode(out.tokens) if tok else None
    if args.chat:  # the reply alone, without the end-of-turn token
        print(tok.decode(out.tokens[:-1] if out.stop == "eos" else out.tokens), flush=True)
    else:
        print((text + new_text) if tok and args.prompt_ids is None else out.tokens, flush=True)
    print(f"[{args.method}] {len(out.tokens)} tokens in {out.decode_s:.2f}s ({out.tokens_per_s:.1f} tok/s), "
          f"{out.steps} steps, {out.tokens_per_step:.2f} tokens/step, stop: {out.stop}", file=sys.stderr)
    if out.stop == "cache_full":
        print(f"note: stopped early: the cache of {S} slots is full; raise --max-len", file=sys.stderr)
    identical = None
    if args.check:
        identical = same_as_ar(out, ref, exact)
        what = "tokens and logits (bitwise)" if exact else "tokens"
        speed = f"; AR {ref.tokens_per_s:.1f} tok/s, so {out.tokens_per_s / ref.tokens_per_s:.2f}x " \
            "(warm, one run; --bench measures)" if args.method != "ar" else ""
        verdict = "identical" if identical else "DIFFERENT: " + first_difference(out, ref)
        print(f"check vs AR ({what}): {verdict}{speed}",
              file=sys.stderr)
    if args.json:
        print(json.dumps({"method": args.method, **info, "prompt": text if args.prompt_ids is None else None,
                          "text": new_text, "token_ids": out.tokens, "new_tokens": len(out.tokens),
                          "steps": out.steps, "mean_accepted": round(out.tokens_per_step, 3),
                          "tokens_per_s": round(out.tokens_per_s, 2), "seconds": round(out.decode_s, 4),
                          "identical_to_ar": identical}))
    return 0 if identical is not False else 1

if __name__ == "__main__":
    cli(main)
