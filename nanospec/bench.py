"""The benchmark behind `decode.py --bench`, and the AR comparison behind `--check`.

Speedups are always against the fastest AR measured in the same run: fast-mode AR (one row per step), and in an
exact-mode bench also exact-mode AR at its own smallest block (on a GPU it replays a CUDA graph, and can be the faster
one). `ar`'s own row, when it is among the methods, decodes as its mode's AR does, timed at other moments, so its runs
join that AR's: one speed read over every timing of a decoding, not the faster of two reads of it (which reads high).
With batch B, the prompts run B at a time, a stopped sequence's row taking the next prompt (engine.generate's batch),
AR too, and a method's speedup is against the AR passes run just before and after each of its own: a slow spell of a
shared machine in mid-run then slows a method and its baseline alike. Mismatches count prompts whose tokens differ
from AR's on that prompt alone, in the benchmark's mode (and, in exact mode, whose accepted logits differ in any bit).
On a GPU each method's kernel time per forward is read with the torch profiler on one prompt.
"""
import copy
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from . import NanospecError, devices
from .engine import Drafter, Output, generate, shapes
from .programs import EAGER, Programs

# tuning.counts, per method (compiled kernels: with --compile)
COUNTS = ("ops_per_layer", "compiled_kernels_per_layer", "step_mb", "launches_per_step", "syncs_per_step")


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
          max_new_tokens=128, eos_id=None, sampling=None, profile=False, peers=(), batch=1,
          block_batch=None, counts=None, dev=None) -> list[dict]:
    """Run every drafter over every prompt (alone: each prompt under AR and every drafter in turn, in order and in
    reverse on the next; batch at a time: each drafter's pass between two of AR's, all twice, the second time in
    reverse, each pass's outputs counted, the budgets reported the first's); one result dict per drafter. Per step:
    step_ms (wall time), forward_ms (the step's device program, synchronised on a GPU) and host_ms,
    the rest: drafting, tree building, read-back, commit; ar_step_ms, a method's median AR step (a budget of 0), and
    ar_step_vs_ar, against AR's own over as many sequences. profile: print each method's host time per step, split
    by phase, and per live batch size its planner's expected and realized tokens per second, AR steps' and drafts'.
    counts: per method, what its exact step costs a GPU (tuning.counts: ops_per_layer, step_mb, launches_per_step,
    syncs_per_step), reported beside. dev: the device's layout and speed every run gets (devices.py)."""
    sampling = sampling or {}
    everyone = [Drafter()] + drafters

    def run(d, prompt, exact, n=max_new_tokens, alone=False, rows=None, at=None, programs=None):
        """prompt: one prompt, or several (a list of Outputs back), decoded rows at a time; alone: a
        reference for a batch's prompt, at the batch's shapes; at: the drafter whose shapes it runs at
        (default: d's own)."""
        longest = max(map(len, prompt if isinstance(prompt[0], list) else prompts if alone else [prompt]))
        Q, S, W = shapes([at or d], longest, max_new_tokens)  # the method's own; its AR reference's too
        return generate(model, prompt, d, max_new_tokens=n, exact=exact, Q=Q, n_slots=S, tail=W, eos_id=eos_id,
                        record_logits=exact, batch=rows, block_batch=block_batch if exact else None, dev=dev,
                        programs=programs, **sampling)

    refs = {}  # (the method's shapes, prompt) -> AR at them: the bitwise reference

    def reference(d, prompt, alone=False):
        key = shapes([d], max(map(len, prompts)) if alone else len(prompt), max_new_tokens) if exact else None
        if (key, tuple(prompt)) not in refs:
            refs[key, tuple(prompt)] = run(Drafter(), prompt, exact, alone=alone, at=d)
        return refs[key, tuple(prompt)]

    # Warm-up: first calls pay for allocation, kernel selection and (on a GPU) graph capture, once
    # per cache size: one prompt of each size, on a copy of each drafter so no state leaks.
    sizes = {tuple(shapes([d], len(p), max_new_tokens) for d in everyone): p for p in prompts}
    for p in sizes.values():
        for d in everyone:
            run(copy.deepcopy(d), p, exact, n=min(8, max_new_tokens))
            if exact:
                run(Drafter(), p, exact, n=min(8, max_new_tokens), at=d)
    eos = model.args.eos_id if eos_id is None else eos_id
    for peer in peers:
        peer.generate(prompts[0], min(8, max_new_tokens), eos)
    # what a profile runs: each drafter as the timed runs find it (after them, a trie would hold their outputs)
    on_gpu = model.embed.weight.device.type == "cuda"  # where kernel_ms has kernels to time
    untouched = [copy.deepcopy(d) if profile or on_gpu else None for d in drafters]
    # Interleaved: each prompt runs under every method in turn, so slow drifts in machine speed
    # (frequent on shared CPUs) hit every method alike.
    t0 = time.perf_counter()
    base = {"fast AR": [], "exact AR": []} if exact else {"fast AR": []}
    ref, outs, peer_outs = [[] for _ in drafters], [[] for _ in drafters], [[] for _ in peers]
    beside = [[] for _ in drafters]  # a batch's: per method, the AR passes just before and after each of its passes
    if batch > 1:  # references: each prompt alone; timings: every prompt, batch at a time, AR's as well
        base.pop("exact AR", None)
        ref = [[reference(d, p, alone=True) for p in prompts] * 2 for d in drafters]

        def timed(d, o, mode):  # one pass over the prompts, batch at a time, in mode (exact or not), into o
            ts = time.perf_counter()
            got = run(d, prompts, mode, rows=batch)
            o += batched(got, time.perf_counter() - ts - got[0].prefill_s)
            print(f"[bench] batch {batch}: {d.name} {sum(len(x.tokens) for x in o) / sum(x.steps for x in o):.2f} "
                  f"tokens/step, {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            return got

        order = list(zip(drafters, outs, beside))
        again = [(copy.deepcopy(d), o, b) for d, o, b in order]  # as fresh as the first time (a trie, a planner)
        # each method's pass between two of AR's, all twice, the second time in reverse: a drift in the machine's
        # speed, or a slow spell, then hits a method and the AR it is measured against alike
        last = timed(Drafter(), base["fast AR"], False)
        for d, o, b in order + again[::-1]:
            b += last
            timed(d, o, exact)
            last = timed(Drafter(), base["fast AR"], False)
            b += last
    for i, p in enumerate(prompts if batch == 1 else ()):
        # fast AR, exact AR at its own smallest block, the methods: in order, then in reverse on the next prompt,
        # so a drift in the machine's speed over a round hits every method alike
        runs = [(Drafter(), o, name == "exact AR") for name, o in base.items()]
        runs += [(d, o, exact) for d, o in zip(drafters, outs)]
        for d, o, mode in runs[::-1] if i % 2 else runs:
            o.append(run(d, p, mode))
        for d, r in zip(drafters, ref):
            r.append(base["fast AR"][-1] if not exact else reference(d, p))
        for peer, o in zip(peers, peer_outs):  # another engine: its own EOS rule, so its output is cut as ours
            ts = time.perf_counter()
            tokens = peer.generate(p, max_new_tokens, eos)
            tokens = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
            o.append(Output(tokens, "", steps=peer.steps, decode_s=time.perf_counter() - ts))
        done = time.perf_counter() - t0
        print(f"[bench] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{d.name} {o[-1].tokens_per_step:.2f}" for d, o in zip(drafters, outs)) + " tokens/step, "
            f"{done:.0f}s, about {done / (i + 1) * (len(prompts) - i - 1):.0f}s left", file=sys.stderr, flush=True)
        ar_tps, baseline, _ = ar_speeds(base, drafters, outs, exact)  # so far: a run cut short says where it stood
        print(f"[bench] so far, {i + 1}/{len(prompts)}: {baseline} {ar_tps:.1f} tok/s; " + ", ".join(
            f"{d.name} {tps(o) / ar_tps:.2f}x" for d, o in zip(drafters, outs)), file=sys.stderr, flush=True)
    ar_tps, baseline, ar_runs = ar_speeds(base, drafters, outs, exact)
    alone = {k: tps(v) for k, v in base.items()}
    alone.update({"AR row": tps(o) for d, o in zip(drafters, outs) if type(d) is Drafter})
    print("[bench] " + ", ".join(f"{k}: {v:.1f} tok/s" for k, v in alone.items()) +
          f" over {len(prompts)} prompts; speedups are against " + (f"{baseline}, {ar_tps:.1f} tok/s" if batch == 1
          else "the AR passes just before and after each method's"), file=sys.stderr, flush=True)
    results = []
    for d, fresh, runs, against, near in zip(drafters, untouched, outs, ref, beside):
        near = near or ar_runs  # alone: the run's AR; a batch: the AR passes beside the method's
        new = sum(len(o.tokens) for o in runs)
        steps = sum(o.steps for o in runs)
        step_ms = 1000 * sum(o.decode_s for o in runs) / steps
        fwd_ms = 1000 * sum(o.forward_s for o in runs) / steps
        kernel = kernel_ms(lambda d, p: run(d, p, exact), fresh, prompts[0]) if on_gpu else None
        if profile:
            base = (devices.of(dev or model.embed.weight).programs if exact else None) or EAGER
            profiled = lambda d, p, programs: run(d, p, exact, rows=batch, programs=programs)
            print(host_profile(profiled, fresh, prompts[:batch], base), file=sys.stderr, flush=True)
            if d.planner is not None:  # per live batch size: what its planner expected of its steps, and got
                print(d.planner.profile(d.name), file=sys.stderr, flush=True)
        results.append(dict(method=d.name, batch=batch, prompts=len(prompts), new_tokens=new, steps=steps,
                            mean_accepted=round(new / steps, 3), step_ms=round(step_ms, 3), forward_ms=round(fwd_ms, 3),
                            host_ms=round(step_ms - fwd_ms, 3), kernel_ms=None if kernel is None else round(kernel, 3),
                            block=shapes([d], max(map(len, prompts)), max_new_tokens)[0] if exact else None,
                            **{k: (counts or {}).get(d.name, {}).get(k) for k in COUNTS},
                            tokens_per_s=round(tps(runs), 2),
                            speedup=round(tps(runs) / tps(near), 3), baseline=baseline if near is ar_runs else
                            "fast AR beside it", baseline_tps=round(tps(near), 2), ar_step_ms=ar_step_ms(runs),
                            ar_step_vs_ar=ar_step_vs(runs, near),
                            mismatches=sum(not same_as_ar(o, r, exact) for o, r in zip(runs, against)),
                            notes=d.report()))
    for peer, runs in zip(peers, peer_outs):
        new, steps = sum(len(o.tokens) for o in runs), sum(o.steps for o in runs)
        results.append(dict(method=peer.name, batch=batch, prompts=len(prompts), new_tokens=new, steps=steps,
                            mean_accepted=round(new / max(steps, 1), 3),
                            step_ms=None, forward_ms=None, host_ms=None, kernel_ms=None, block=None,
                            **{k: None for k in COUNTS},
                            tokens_per_s=round(tps(runs), 2),
                            speedup=round(tps(runs) / ar_tps, 3), baseline=baseline, baseline_tps=round(ar_tps, 2),
                            mismatches=sum(o.tokens != r.tokens for o, r in zip(runs, base["fast AR"])), notes=""))
    return results


def batched(outs: list[Output], seconds: float) -> list[Output]:
    """A batch's outputs, its decoding time (seconds) shared out by tokens (sums give the batch's
    tokens/s; each output's forward_s is its share of the forwards already)."""
    total = max(sum(len(o.tokens) for o in outs), 1)
    for o in outs:
        o.decode_s = seconds * len(o.tokens) / total
    return outs


def ar_step_ms(runs: list[Output]) -> float | None:
    """The median AR step's milliseconds (a batch's: each sequence's share): a method's own (a budget of 0), AR's."""
    steps = [s / n for o in runs for n, s in o.ar_steps]
    return round(1000 * statistics.median(steps), 3) if steps else None


def ar_step_vs(runs: list[Output], ar: list[Output]) -> float | None:
    """A method's AR steps' time against AR's own over as many sequences (the steps of a batch's last sequences cost
    about what a full batch's do, over fewer sequences), medians weighted by the method's steps: a slow spell of a
    shared machine lands on a few steps of one method, and a mean would charge it to the method."""
    def by_size(outs):
        steps = {}
        for n, s in (x for o in outs for x in o.ar_steps):
            steps.setdefault(n, []).append(s)
        return steps
    own, mine = by_size(ar), by_size(runs)
    both = [(len(v), statistics.median(v), statistics.median(own[n])) for n, v in mine.items() if n in own]
    return round(sum(c * m for c, m, _ in both) / sum(c * a for c, _, a in both), 3) if both else None


def tps(runs: list[Output]) -> float:
    return sum(len(o.tokens) for o in runs) / sum(o.decode_s for o in runs)


def ar_speeds(base: dict, drafters: list[Drafter], outs: list[list[Output]], exact: bool) -> tuple[float, str, list]:
    """The speedups' baseline: the fastest kind of AR (tok/s, its name, its runs). The AR row joins the AR of its
    mode (exact or fast) when the bench ran one: the same decoding, so one speed measured over both."""
    kinds = {name: list(runs) for name, runs in base.items()}
    mode = "exact AR" if exact else "fast AR"
    for runs in (runs for d, runs in zip(drafters, outs) if type(d) is Drafter):
        kinds.setdefault(mode if mode in base else "AR row", []).extend(runs)
    name = max(kinds, key=lambda k: tps(kinds[k]))
    return tps(kinds[name]), name, kinds[name]


def kernel_ms(run, drafter, prompt) -> float | None:
    """GPU kernel time per decoding forward (torch profiler, prefill excluded); None where nothing ran on a GPU."""
    d = copy.deepcopy(drafter)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    start, finish = d.start, d.finish

    def start_profiled(dec):  # the engine calls start after prefill and finish at the end
        if dec.device.type == "cuda":
            dec.dev.sync(dec.device)
            prof.start()
        start(dec)

    def finish_profiled(dec):
        finish(dec)
        if dec.device.type == "cuda":
            dec.dev.sync(dec.device)
            prof.stop()

    d.start, d.finish = start_profiled, finish_profiled
    out = run(d, prompt)
    if prof.profiler is None:  # never started: not on a GPU
        return None
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us / 1000 / out.steps


class Unprofiled(Programs):
    """Programs as base runs them, with the profiler off inside each program (its time is forward_ms's)."""

    def __init__(self, prof, base: Programs):
        self.prof, self.base = prof, base

    def cache(self, model, key, make):
        return self.base.cache(model, key, make)

    def run(self, *args):
        self.prof.disable()
        try:
            return self.base.run(*args)
        finally:
            self.prof.enable()


PHASES = {  # a step's parts, by the functions that run them (file, name): engine.step calls each in turn
    "draft": ("engine.py", "draft"), "of which the planner": (None, "budget"), "lay out": ("engine.py", "lay_out"),
    "launch": ("engine.py", "launch_step"), "read back": ("engine.py", "read_back"),
    "settle on the host (sampling)": ("verify.py", "settle_on_host"),
    "the drafter's bookkeeping": (None, "accepted"), "the planner's learning": (None, "observe")}


def host_profile(run, drafter, prompts, base: Programs, top: int = 12) -> str:
    """Where a step's host time goes: cProfile over prompts (several: a batch), switched off inside the model's
    forwards (each step's device program, whose time forward_ms counts, and the prefill), so only host work is
    listed: the split by PHASES (each the slowest function of its name: an override includes its super call), then
    the top functions by own time."""
    d = copy.deepcopy(drafter)
    prof = cProfile.Profile()
    prof.enable()
    outs = run(d, prompts, Unprofiled(prof, base))
    prof.disable()
    steps = max(o.steps for o in outs)  # a batch's steps, which every sequence shares
    stats = pstats.Stats(prof).stats.items()
    per_step = lambda where, name: max((1000 * ct / steps for fn, (cc, nc, tt, ct, callers) in stats
                                        if fn[2] == name and where in (None, Path(fn[0]).name)), default=0.0)
    split = ", ".join(f"{k} {per_step(*fn):.3f}" for k, fn in PHASES.items())
    lines = [f"[profile] {drafter.name}, {len(outs)} at a time: {steps} steps; host ms per step: {split}",
             f"[profile] {drafter.name}: top host functions by own time, ms per step:"]
    for fn, (cc, nc, tt, ct, callers) in sorted(stats, key=lambda kv: -kv[1][2])[:top]:
        where = fn[2] if fn[0] == "~" else f"{Path(fn[0]).name}:{fn[1]}({fn[2]})"
        lines.append(f"  {1000 * tt / steps:8.3f}  {where}")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    cols = ["method", "batch", "prompts", "new_tokens", "steps", "mean_accepted", "step_ms", "forward_ms", "host_ms",
            "kernel_ms", "block", *COUNTS, "ar_step_vs_ar", "tokens_per_s", "speedup", "mismatches"]
    rows = [cols] + [["-" if r.get(c) is None else str(r[c]) for c in cols] for r in results]
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    notes = [f"{r['method']}: {r['notes']}" for r in results if r.get("notes")]
    return "\n".join(["  ".join(v.rjust(w[i]) for i, v in enumerate(r)) for r in rows] + notes)
