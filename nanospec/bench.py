"""The benchmark behind `decode.py --bench`, and the AR comparison behind `--check`.

Speedups are always against fast-mode AR (one row per step) measured in the same
run; mismatches count prompts whose tokens differ from AR's in the benchmark's mode.
"""
import copy
import json
import sys
import time
from pathlib import Path

from . import NanospecError
from .engine import Drafter, generate, shapes


def load_prompts(path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise NanospecError(f"no prompt file at {path}: pass --prompts FILE.jsonl with {{\"prompt\": ...}} lines")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise NanospecError(f"{path}:{i} is not a JSON object with a \"prompt\" field") from None
    if not prompts:
        raise NanospecError(f"{path} holds no prompts")
    return prompts


def same_as_ar(out, ref, exact: bool) -> bool:
    """Token equality; in exact mode also bitwise equality of every accepted position's logits."""
    if out.tokens != ref.tokens:
        return False
    return not exact or (out.logits is not None and out.logits.equal(ref.logits))


def first_difference(out, ref) -> str:
    for i, (a, b) in enumerate(zip(out.tokens, ref.tokens)):
        if a != b:
            return f"token {i}: {a} vs AR {b}"
    if len(out.tokens) != len(ref.tokens):
        return f"length {len(out.tokens)} vs AR {len(ref.tokens)}"
    diff = (out.logits != ref.logits).any(-1).nonzero()
    return f"logits differ at token {int(diff[0])}" if len(diff) else "identical"


def bench(model, prompts: list[list[int]], drafters: list[Drafter], *, exact=False,
          max_new_tokens=128, eos_id=None, sampling=None, log=sys.stderr) -> list[dict]:
    """Run every drafter over every prompt; one result dict per drafter."""
    sampling = sampling or {}
    everyone = [Drafter()] + drafters

    def run(d, prompt, exact, n=max_new_tokens):
        Q, S = shapes(everyone, len(prompt), max_new_tokens)  # same shapes for every run of a prompt
        return generate(model, prompt, d, max_new_tokens=n, exact=exact, Q=Q, n_slots=S,
                        eos_id=eos_id, record_logits=exact, **sampling)

    for d in everyone:  # warm-up: first calls pay for allocation and kernel selection; a copy,
        run(copy.deepcopy(d), prompts[0], exact, n=min(8, max_new_tokens))  # so no state leaks
    # Interleaved: each prompt runs under every method in turn, so slow drifts in machine speed
    # (frequent on shared CPUs) hit every method alike.
    t0 = time.perf_counter()
    fast_ar, ref, outs = [], [], [[] for _ in drafters]
    for i, p in enumerate(prompts):
        fast_ar.append(run(Drafter(), p, False))
        ref.append(fast_ar[-1] if not exact else run(Drafter(), p, True))
        for d, o in zip(drafters, outs):
            o.append(run(d, p, exact))
        print(f"[bench] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{d.name} {o[-1].mean_accepted:.2f}" for d, o in zip(drafters, outs)) + " tokens/step, "
            f"{time.perf_counter() - t0:.0f}s", file=log, flush=True)
    ar_tps = sum(len(o.tokens) for o in fast_ar) / sum(o.decode_s for o in fast_ar)
    print(f"[bench] fast AR: {ar_tps:.1f} tok/s over {len(prompts)} prompts", file=log, flush=True)
    results = []
    for d, runs in zip(drafters, outs):
        new = sum(len(o.tokens) for o in runs)
        steps = sum(o.steps for o in runs)
        tps = new / sum(o.decode_s for o in runs)
        fwd_ms = 1000 * sum(sum(o.forward_s) for o in runs) / steps
        results.append(dict(method=d.name, prompts=len(prompts), new_tokens=new, steps=steps,
                            mean_accepted=round(new / steps, 3), forward_ms=round(fwd_ms, 2),
                            tokens_per_s=round(tps, 2),
                            speedup=round(tps / ar_tps, 3),
                            mismatches=sum(not same_as_ar(o, r, exact) for o, r in zip(runs, ref)),
                            notes=d.report()))
    return results


def table(results: list[dict]) -> str:
    cols = ["method", "prompts", "new_tokens", "steps", "mean_accepted", "forward_ms", "tokens_per_s", "speedup",
            "mismatches"]
    rows = [cols] + [[str(r[c]) for c in cols] for r in results]
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    notes = [f"{r['method']}: {r['notes']}" for r in results if r.get("notes")]
    return "\n".join(["  ".join(v.rjust(w[i]) for i, v in enumerate(r)) for r in rows] + notes)
