"""transformers as the engine under test: its model of the weights' family (AutoModelForCausalLM: Llama, Mistral,
Qwen2, Qwen3) and its generate, greedy, on the same weights.

Settings: plain greedy, prompt lookup (prompt_lookup_num_tokens=10) and assisted generation
(assistant_model: by default the same checkpoint cut to its first --assistant-layers layers), in
each --dtype. Each is compared with nanospec's exact AR trace in the same dtype; prompt lookup and
assisted generation also with transformers' own greedy output (self-consistency), judged on
transformers' own logits (generate's output_logits). --batch B also decodes the prompts B at a
time, left-padded (pad: the EOS id, as generate's users set it), judged against the reference and
against each prompt decoded alone, on the lone run's logits. --calibrate measures instead how far
transformers' forward moves the reference's top-2 gaps (calibration.py), alone and, with --batch,
in left-padded batches (the batch's own tolerance).
"""
import sys
import time
from pathlib import Path

import torch

from ... import NanospecError, check_device
from ...io.checkpoint import DTYPES, load, load_args
from ...io.files import fingerprint
from ...io.sources import base_of, resolve
from .. import calibration as cal
from .. import noise
from ..verdict import coarser, compare
from . import Whole, progress, prompt_texts, reference, references, save, tokenizer, top

SETTINGS = {"greedy": "plain greedy", "prompt_lookup": "prompt lookup (prompt_lookup_num_tokens=10)",
            "assisted": "assisted generation (assistant_model)"}


def left_padded(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of sequences left-padded to the longest, as transformers' users batch."""
    n = max(map(len, seqs))
    ids = torch.tensor([[pad] * (n - len(q)) + q for q in seqs], device=device)
    mask = torch.tensor([[0] * (n - len(q)) + [1] * len(q) for q in seqs], device=device)
    return ids, mask


def outputs(hf, prompts, setting, max_new_tokens, eos_id, assistant=None, batch: int = 1) -> list[dict]:
    """transformers' generate, greedy, in one of SETTINGS, with the logit row of every new token; the
    prompts `batch` at a time, left-padded (batch > 1: does batching change the output?)."""
    extra = {"greedy": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 10},
             "assisted": {"assistant_model": assistant}}[setting]
    outs, t0 = [], time.perf_counter()
    for k in range(0, len(prompts), batch):
        group = prompts[k:k + batch]
        ids, mask = left_padded(group, eos_id, hf.device)
        with torch.no_grad():
            y = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos_id, pad_token_id=eos_id, return_dict_in_generate=True,
                            output_logits=True, **extra)
        for b, p in enumerate(group):
            new = y.sequences[b, ids.shape[1]:].tolist()
            new = new[:new.index(eos_id) + 1] if eos_id in new else new  # a finished row is padded on
            outs.append({"prompt_ids": p, "output_ids": new, "dtype": str(hf.dtype).removeprefix("torch."),
                         "eos_id": eos_id, "positions": [top(r[b].float().cpu()) for r in y.logits[:len(new)]]})
        progress(f"transformers {setting}" + batch_key(batch), min(k + batch, len(prompts)) - 1, len(prompts), t0)
    return outs


def calibrate(ref: list[dict], hf, units: str, batch: int = 1) -> dict:
    """transformers' logits, teacher-forced over the reference's sequences (`batch` at a time,
    left-padded, positions counted from each sequence's first token), against its rows."""
    moves, samples, t0 = [], [], time.perf_counter()
    for k in range(0, len(ref), batch):
        group = ref[k:k + batch]
        ids, mask = left_padded([e["prompt_ids"] + e["output_ids"] for e in group], 0, hf.device)
        with torch.no_grad():
            logits = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        for b, e in enumerate(group):
            end, n = ids.shape[1] - 1, len(e["output_ids"])
            rows = logits[b, end - n:end].float().cpu()
            moves.append(cal.movements(e["positions"], rows, units))
            samples.append(noise.sample(e["positions"], rows))
        progress("calibration" + batch_key(batch), min(k + batch, len(ref)) - 1, len(ref), t0)
    return {**cal.entry(torch.cat(moves), units), "noise": noise.merge(samples, "transformers")}


def batch_key(batch: int) -> str:
    return f" batch {batch}" if batch > 1 else ""


def noise_of(calib: dict | None, name: str) -> dict:
    """Whole.of's calibrated noise for a run: the calibration's entry for this setting, if any."""
    if calib and name in calib["settings"]:
        return {"calibrated": [calib["settings"][name]], "source": name}
    return {}


def tolerance_of(calib: dict | None, name: str) -> dict:
    """A run's tolerance: the calibration's entry for this dtype, else ({}) the float rule."""
    if calib and name in calib["settings"]:
        e = calib["settings"][name]
        return {"units": e["units"], "ulps": e["ulps"], "calibrated": name}
    return {}


def verdicts(refs, others, tol: dict, ulps=None) -> list[dict]:
    return compare(refs, others, None, ulps or tol.get("ulps"), units=tol.get("units"))


def run(args) -> list[dict]:
    """Every (dtype, setting): nanospec's exact AR trace vs transformers' generate on the same weights."""
    try:
        import transformers
    except ImportError:
        raise NanospecError("--engine transformers needs transformers: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    weights = resolve(args.weights, log=sys.stderr)
    check_device(args.device)
    settings = args.settings.split(",") if args.settings else list(SETTINGS)
    for s in settings:
        if s not in SETTINGS:
            raise NanospecError(f"unknown setting {s!r} for transformers: one of {', '.join(SETTINGS)}")
    if args.assistant:
        args.assistant = resolve(args.assistant, log=sys.stderr)
    if args.assistant and "assisted" in settings \
            and load_args(args.assistant).vocab_size != load_args(base_of(weights)).vocab_size:
        raise NanospecError(f"the assistant at {args.assistant} has another vocabulary than {weights}: "
                            "assisted generation needs the same tokenizer")
    tok = tokenizer(weights)
    prompts = [tok.encode(t) for t in prompt_texts(args, weights)]
    calib = cal.read(args.calibration) if args.calibration else None
    runs, found, judge = [], {}, Whole(args, weights)
    for name in (args.dtype or "float32,bfloat16").split(","):
        if name not in DTYPES:
            raise NanospecError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
        model = load(base_of(weights), DTYPES[name], args.device)
        if calib and calib.get("model") not in (None, fingerprint(model)):
            raise NanospecError(f"{args.calibration} calibrates other weights (fingerprint {calib['model']})")
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_of(weights), dtype=DTYPES[name])
        hf = hf.to(args.device).eval()
        if name == "float32" and args.device == "cpu" and judge.fp32 is None:
            judge.fp32 = model  # the whole-output test's reference: nanospec fp32 on the CPU
        if args.calibrate:  # transformers in this dtype against nanospec in it, and against fp32 nanospec
            fp32 = [load(base_of(weights), torch.float32, args.device)] if name != "float32" else []
            for ref_model in [model] + fp32:
                ref_dtype = str(ref_model.embed.weight.dtype).removeprefix("torch.")
                units = coarser(name, ref_dtype)
                ref = reference(ref_model, prompts, args.max_new_tokens)
                for batch in sorted({1, args.batch}) if ref_dtype == name else [1]:
                    e = calibrate(ref, hf, units, batch)
                    key = (name if ref_dtype == name else f"{name} vs {ref_dtype} reference") + batch_key(batch)
                    found[key] = e
                    runs.append({"engine": "transformers", "setting": "calibration", "dtype": name,
                                 "device": args.device, "reference_dtype": ref_dtype, "batch": batch, **e})
                    print(f"calibration: transformers {key} vs nanospec exact AR {ref_dtype}: top-2 gaps move by at "
                          f"most {e['max']} (p99.9 {e['p99.9']}, median {e['median']}) x eps({units}) x logit scale "
                          f"over {e['positions']} positions ({e['flips']} flips left out); the float rule's tolerance "
                          f"is {cal.ULPS[units]}, the calibrated one {e['ulps']}")
            continue
        refs = references(args, model, prompts)
        assistant = None
        if "assisted" in settings:
            src = Path(args.assistant) if args.assistant else base_of(weights)
            kw = {} if args.assistant else {"num_hidden_layers": args.assistant_layers}
            assistant = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[name], **kw)
            assistant = assistant.to(args.device).eval()
        save(args, f"nanospec-ar-{name}", refs)
        tol = tolerance_of(calib, name)
        greedy = None
        for s in (["greedy"] if args.batch > 1 and "greedy" not in settings else []) + settings:
            others = outputs(hf, prompts, s, args.max_new_tokens, model.args.eos_id, assistant)
            save(args, f"transformers-{s}-{name}", others)
            common = {"engine": "transformers", "setting": s, "dtype": name, "device": args.device}
            if refs is not None:
                runs.append({**common, "against": "reference", **tol, "results": verdicts(refs, others, tol, args.ulps),
                             **judge.of(refs, others, name, model, **noise_of(calib, name))})
            if s == "greedy":
                greedy = others
            elif greedy is not None:  # does turning speculation on change transformers' output?
                runs.append({**common, "against": "greedy", **tol,
                             "results": verdicts(greedy, others, tol, args.ulps), **judge.own(greedy, others)})
        if args.batch > 1:  # does batching change it? Judged like speculation, with the batch's own tolerance
            others = outputs(hf, prompts, "greedy", args.max_new_tokens, model.args.eos_id, batch=args.batch)
            save(args, f"transformers-batch{args.batch}-{name}", others)
            common, tol = {"engine": "transformers", "setting": f"greedy batch {args.batch}", "dtype": name,
                           "device": args.device}, tolerance_of(calib, name + batch_key(args.batch)) or tol
            if refs is not None:
                runs.append({**common, "against": "reference", **tol, "results": verdicts(refs, others, tol, args.ulps),
                             **judge.of(refs, others, name, model, **noise_of(calib, name + batch_key(args.batch)))})
            runs.append({**common, "against": "alone", **tol, "results": verdicts(greedy, others, tol, args.ulps)})
    if args.calibrate and args.save_calibration:
        cal.write(args.save_calibration, found, engine="transformers", engine_version=transformers.__version__,
                  model=fingerprint(load(base_of(weights))), weights=str(args.weights), prompts=len(prompts),
                  max_new_tokens=args.max_new_tokens)
    return runs
