"""llama.cpp as the engine under test, through llama-cpp-python (an optional extra).

llama.cpp's own loop (Llama.generate) runs greedy (top_k 1, temperature 0, no repeat penalty) on
prompt ids from nanospec's tokenizer, in three settings:
- greedy: one token per evaluation, only the last row's logits (llama.cpp's default);
- prompt_lookup: LlamaPromptLookupDecoding(num_pred_tokens=10); drafts are verified in batches;
- draft: a draft model (a second Llama: --assistant, by default the first --assistant-layers
  layers of the weights as an F32 GGUF) proposes --draft-tokens greedy tokens through the same
  draft_model hook.
for each KV cache type in --kv (f16, llama.cpp's default, and f32). --weights FILE.gguf is run as
it is; a directory is exported once into the cache as an F32 GGUF (sources.as_gguf).
--batch B adds `greedy batch B`: the prompts B at a time as sequences of one context (seq ids
0..B-1, llama.cpp's parallel decoding as its server's slots run it), each step one llama_decode
over every live sequence's next token, judged against the reference and against the same prompt
decoded alone by `greedy`.

llama.cpp computes otherwise than nanospec (quantized activations against quantized weights,
batches through other kernels than single tokens), so it gets its own tolerance: unless
--calibration gives one, it is measured first, teacher-forced over the reference's sequences:
`single` evaluates one token at a time as greedy does, `batched` in chunks of 11 (the last token
and 10 drafts) as prompt lookup's verification does; and `self`, with no reference: chunks of 11
over llama.cpp's own greedy output, against its own greedy rows. Greedy is judged with
`single`, the speculative settings with the wider of `single` and `batched` against the
reference, and with `self` against llama.cpp's own greedy output. The tokenizer is checked too:
llama.cpp's tokenize() of each prompt text against nanospec's ids.
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ... import NanospecError
from ...io.checkpoint import load
from ...io.files import fingerprint
from ...io.sources import as_gguf, base_of, resolve
from .. import calibration as cal
from .. import noise
from ..verdict import compare
from . import Whole, progress, prompt_texts, references, save, tokenizer, tokens_per_s, top

INSTALL = ('pip install "nanospec[llamacpp]" (llama-cpp-python: it builds llama.cpp from source, some minutes; '
           'CPU: CMAKE_ARGS="-DGGML_NATIVE=OFF")')
SETTINGS = ["greedy", "prompt_lookup", "draft"]
KV = {"f16": 1, "f32": 0}  # GGML type ids
CHUNK = 11  # a prompt-lookup verification: the last token and num_pred_tokens=10 drafts
GREEDY = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)


def need():
    try:
        import llama_cpp
    except ImportError:
        raise NanospecError(f"--engine llama.cpp needs llama-cpp-python: {INSTALL}") from None
    return llama_cpp


def open_llama(path: Path, n_ctx: int, kv: str, threads: int | None, logits_all=False, draft=None):
    """threads None: llama-cpp-python's defaults (half the cores for single tokens, all for batches)."""
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, type_k=KV[kv], type_v=KV[kv], draft_model=draft, seed=0, verbose=False)


def last_row(llm) -> np.ndarray:
    """The logits llama.cpp's sampler reads after an evaluation without logits_all: the last row."""
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


def make_draft(llm, n: int):
    """A draft model for Llama's draft_model hook: another Llama's greedy continuation, n tokens."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class Draft(LlamaDraftModel):
        def __call__(self, input_ids, **kw):
            out = []
            for t in llm.generate(input_ids.tolist(), **GREEDY):  # reuses its cache for the common prefix
                out.append(t)
                if len(out) == n:
                    break
            return np.array(out, dtype=np.intc)
    return Draft()


def decode(llm, prompts, max_new_tokens, eos_id, tag, all_rows: bool) -> list[dict]:
    """Llama.generate, greedy, with the row each token came from (its top-k) and the decoding time.
    all_rows: the Llama keeps every row (logits_all, as a draft model forces), else only the last."""
    outs, t0 = [], time.perf_counter()
    for k, p in enumerate(prompts):
        llm.reset()  # no prefix reuse across prompts: each prompt is evaluated as if alone
        ids, rows, first = [], [], None
        for tok in llm.generate(p, **GREEDY):
            row = llm.scores[len(p) + len(ids) - 1] if all_rows else last_row(llm)
            rows.append(top(row))
            ids.append(int(tok))
            if first is None:
                first = time.perf_counter()  # the prompt is evaluated: decoding starts
            if tok == eos_id or len(ids) == max_new_tokens:
                break
        outs.append({"prompt_ids": p, "output_ids": ids, "eos_id": eos_id, "positions": rows,
                     "decode_s": time.perf_counter() - first})
        progress(f"llama.cpp {tag}", k, len(prompts), t0)
    return outs


def parallel(llm, prompts, batch: int, max_new_tokens: int, eos_id: int, tag: str) -> list[dict]:
    """Greedy decoding of the prompts `batch` at a time in one context of llm's model and settings
    (n_seq_max = batch, batch x its n_ctx): each sequence's prompt in its own llama_decode, then one
    llama_decode per step over the next token of every live sequence. Greedy: the row's largest
    logit, ties to the smaller id (Llama.generate's top_k=1 sampler)."""
    import llama_cpp
    from llama_cpp import _internals
    params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    params.n_seq_max, params.n_ctx = batch, batch * llm.context_params.n_ctx
    ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    step = _internals.LlamaBatch(n_tokens=max(batch, *map(len, prompts)), embd=0, n_seq_max=1, verbose=False)
    V, outs, t0 = llm.n_vocab(), [], time.perf_counter()

    def decode() -> list:
        if llama_cpp.llama_decode(ctx.ctx, step.batch) != 0:
            raise NanospecError(f"llama.cpp: llama_decode failed ({tag})")
        return [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, j), shape=(V,)).copy()
                for j in range(step.n_tokens()) if step.batch.logits[j]]

    for k in range(0, len(prompts), batch):
        group = prompts[k:k + batch]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx.ctx), True)
        rows = []
        for i, p in enumerate(group):
            step.reset()
            step.add_sequence(p, i, False)
            rows.append(decode()[0])
        ids, positions, live, first = [[] for _ in group], [[] for _ in group], list(range(len(group))), None
        while live:
            for i, row in zip(live, rows):
                positions[i].append(top(row))
                ids[i].append(int(np.argmax(row)))
            live = [i for i in live if ids[i][-1] != eos_id and len(ids[i]) < max_new_tokens]
            first = first or time.perf_counter()
            b = step.batch
            for j, i in enumerate(live):  # sequence i's last token, at its position, its logits kept
                b.token[j], b.pos[j] = ids[i][-1], len(group[i]) + len(ids[i]) - 1
                b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = i, 1, True
            b.n_tokens = len(live)
            rows = decode() if live else []
        spent = (time.perf_counter() - first) / len(group)  # the group's decoding time, shared
        outs += [{"prompt_ids": p, "output_ids": o, "eos_id": eos_id, "positions": r, "decode_s": spent}
                 for p, o, r in zip(group, ids, positions)]
        progress(f"llama.cpp {tag}", min(k + batch, len(prompts)) - 1, len(prompts), t0)
    ctx.close()
    step.close()
    return outs


def forced(llm, prompt: list[int], tokens: list[int], chunk: int) -> torch.Tensor:
    """llama.cpp's rows for the positions of `tokens` after `prompt`, teacher-forced: the prompt in
    one batch, as generate evaluates it, then `tokens` in batches of `chunk` (1: as greedy does;
    more needs logits_all)."""
    llm.reset()
    llm.eval(prompt)
    rows = [llm.scores[len(prompt) - 1].copy() if chunk > 1 else last_row(llm)]
    rest = tokens[:-1]
    for i in range(0, len(rest), chunk):
        llm.eval(rest[i:i + chunk])
        if chunk == 1:
            rows.append(last_row(llm))
    if chunk > 1:
        rows += list(llm.scores[len(prompt):len(prompt) + len(rest)].copy())
    return torch.from_numpy(np.stack(rows))


def calibrate(llm, entries: list[dict], chunk: int, tag: str) -> dict:
    moves, samples, t0 = [], [], time.perf_counter()
    for i, e in enumerate(entries):
        rows = forced(llm, e["prompt_ids"], e["output_ids"], chunk)
        moves.append(cal.movements(e["positions"], rows, "float32"))
        samples.append(noise.sample(e["positions"], rows))
        progress(f"calibration {tag}", i, len(entries), t0)
    return {**cal.entry(torch.cat(moves), "float32"), "noise": noise.merge(samples, "llama.cpp")}


def check_tokenizer(llm, texts: list[str], ids: list[list[int]]) -> dict:
    """llama.cpp's tokenize() of each prompt text (BOS as the file says; special tokens such as
    ChatML's <|im_start|> parsed, as nanospec's tokenizer parses them) against nanospec's ids."""
    differ = []
    for k, (text, mine) in enumerate(zip(texts, ids)):
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if theirs != mine:
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            differ.append({"prompt": k, "position": i, "nanospec": mine[i:i + 4], "llama.cpp": theirs[i:i + 4]})
    return {"engine": "llama.cpp", "check": "tokenizer", "prompts": len(texts), "differ": len(differ),
            "examples": differ}


def describe(e: dict, name: str) -> str:
    return (f"calibration: llama.cpp {name}: top-2 gaps move by at most {e['max']} (p99.9 {e['p99.9']}, median "
            f"{e['median']}) x eps({e['units']}) x logit scale, {e['max_logits']:.3g} logits, over {e['positions']} "
            f"positions ({e['flips']} flips left out): tolerance {e['ulps']}")


def run(args) -> list[dict]:
    llama_cpp = need()
    settings = args.settings.split(",") if args.settings else SETTINGS
    kvs = args.kv.split(",")
    for s in settings:
        if s not in SETTINGS:
            raise NanospecError(f"unknown setting {s!r} for llama.cpp: one of {', '.join(SETTINGS)}")
    for kv in kvs:
        if kv not in KV:
            raise NanospecError(f"unknown --kv {kv!r}: one of {', '.join(KV)}")
    if args.dtype not in (None, "float32"):
        raise NanospecError("--engine llama.cpp compares with nanospec's fp32 reference: no --dtype")
    if args.device != "cpu":
        raise NanospecError("--engine llama.cpp runs here on the CPU (llama-cpp-python's CPU build): no --device")
    weights = resolve(args.weights, log=sys.stderr)
    model = load(base_of(weights))
    fp = fingerprint(model)
    gguf = as_gguf(args.weights, base_of(weights), log=sys.stderr)
    draft_gguf = None
    if "draft" in settings and not args.calibrate:
        draft_gguf = (as_gguf(args.assistant, resolve(args.assistant, log=sys.stderr), log=sys.stderr) if args.assistant
                      else as_gguf(None, base_of(weights), layers=args.assistant_layers, log=sys.stderr))
    calib = cal.read(args.calibration) if args.calibration else None
    if calib and calib.get("model") not in (None, fp):
        raise NanospecError(f"{args.calibration} calibrates other weights (fingerprint {calib['model']}, these {fp})")
    tok = tokenizer(weights)
    texts = prompt_texts(args, weights)
    prompts = [tok.encode(t) for t in texts]
    refs = references(args, model, prompts)
    save(args, "nanospec-ar-float32", refs)
    n_ctx = max(map(len, prompts)) + args.max_new_tokens + max(CHUNK, args.draft_tokens) + 8
    threads = args.threads
    common = {"engine": "llama.cpp", "file": Path(gguf).name}
    runs, measured, whole = [], {}, Whole(args, weights, model)

    def tolerance(kv: str, names: list[str]) -> dict:
        names = [f"{n} kv={kv}" for n in names]
        e = cal.widest(calib or {"settings": measured}, names)
        return {"units": e["units"], "ulps": e["ulps"], "calibrated": " | ".join(names)}

    def judge(refs_, outs, tol, **kw):
        names = tol["calibrated"].split(" | ")
        against = whole.own(refs_, outs) if kw["against"] == "greedy" else {} if kw["against"] != "reference" \
            else whole.of(refs_, outs, "float32", source=tol["calibrated"],
                          calibrated=[(calib or {"settings": measured})["settings"][n] for n in names])
        return {**common, **kw, **tol, **against, "results": compare(refs_, outs, None, args.ulps or tol["ulps"],
                                                                     units=tol["units"])}

    for kv in kvs:
        single = open_llama(gguf, n_ctx, kv, threads)
        batched = open_llama(gguf, n_ctx, kv, threads, logits_all=True)
        if kv == kvs[0]:
            runs.append({**common, **check_tokenizer(single, texts, prompts)})
            r = runs[-1]
            print(f"tokenizer: llama.cpp's tokenize() gives other ids than nanospec's for {r['differ']} of "
                  f"{r['prompts']} prompts" + "".join(f"; prompt {x['prompt']} at token {x['position']}: nanospec "
                                                      f"{x['nanospec']}, llama.cpp {x['llama.cpp']}"
                                                      for x in r["examples"][:3]))
        if not calib and refs is not None:
            for name, llm, chunk in (("single", single, 1), ("batched", batched, CHUNK)):
                measured[f"{name} kv={kv}"] = calibrate(llm, refs, chunk, f"{name} kv={kv}")
                print(describe(measured[f"{name} kv={kv}"], f"{name} kv={kv}"), flush=True)
        greedy = None
        order = (["greedy"] if args.batch > 1 and "greedy" not in settings else []) + settings  # --batch: alone
        for s in (["greedy"] if args.calibrate else order):  # --calibrate: greedy, for `self`
            if s == "greedy":
                llm = single
            else:
                lookup = llama_cpp.llama_speculative.LlamaPromptLookupDecoding
                draft = (lookup(num_pred_tokens=10) if s == "prompt_lookup"
                         else make_draft(open_llama(draft_gguf, n_ctx, kv, threads), args.draft_tokens))
                llm = open_llama(gguf, n_ctx, kv, threads, draft=draft)
            outs = decode(llm, prompts, args.max_new_tokens, model.args.eos_id, f"{s} kv={kv}", s != "greedy")
            save(args, f"llama.cpp-{s}-kv{kv}", outs)
            speed = {"tokens_per_s": tokens_per_s(outs)}
            print(f"speed: llama.cpp {s} kv={kv}: {speed['tokens_per_s']} tok/s decoding (prompt evaluation excluded), "
                  f"{sum(len(o['output_ids']) for o in outs)} new tokens over {len(outs)} prompts", flush=True)
            if s == "greedy":
                greedy = outs
                if not calib:  # self-consistency's own tolerance: batched against single, no reference
                    measured[f"self kv={kv}"] = calibrate(batched, greedy, CHUNK, f"self kv={kv}")
                    print(describe(measured[f"self kv={kv}"], f"self kv={kv} (batched vs its own greedy rows)"))
                if not args.calibrate and refs is not None:
                    runs.append(judge(refs, outs, tolerance(kv, ["single"]), setting=s, kv=kv, against="reference",
                                      **speed))
                if args.batch > 1 and not args.calibrate:  # does batching change it? Judged as speculation is
                    tag = f"greedy batch {args.batch}"
                    others = parallel(single, prompts, args.batch, args.max_new_tokens, model.args.eos_id,
                                      f"{tag} kv={kv}")
                    save(args, f"llama.cpp-batch{args.batch}-kv{kv}", others)
                    if refs is not None:
                        runs.append(judge(refs, others, tolerance(kv, ["single", "batched"]), setting=tag, kv=kv,
                                          against="reference", tokens_per_s=tokens_per_s(others)))
                    runs.append(judge(outs, others, tolerance(kv, ["self"]), setting=tag, kv=kv, against="alone"))
                continue
            if refs is not None:
                runs.append(judge(refs, outs, tolerance(kv, ["single", "batched"]), setting=s, kv=kv,
                                  against="reference", **speed))
            if greedy is not None:
                runs.append(judge(greedy, outs, tolerance(kv, ["self"]), setting=s, kv=kv, against="greedy"))
    for name, e in measured.items():
        runs.append({**common, "setting": "calibration", "calibration": name, **e})
    if args.save_calibration:
        cal.write(args.save_calibration, measured, engine="llama.cpp", engine_version=llama_cpp.__version__,
                  model=fp, weights=Path(gguf).name, prompts=len(prompts), max_new_tokens=args.max_new_tokens)
    return runs
