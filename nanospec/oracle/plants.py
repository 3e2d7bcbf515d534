"""Planted engine bugs, for the oracle's detection floors (floors.py) and its tests: each class applied to a
nanospec model as a context manager that changes the model's configuration or modules and restores them on
exit (the core's source stays as it is), or, for engine-level bugs, to the decoding around the model.

Model-level classes, with a strength:
- rope_base: RoPE's base divided by the strength (a converter that reads the wrong rope_theta);
- rope_scaling: the checkpoint's rope_scaling left out (only where it has one);
- norm_eps: every RMSNorm's epsilon multiplied by the strength;
- qk_norm: Qwen3's per-head q/k norms left out (only where the model has them);
- window: the sliding window one key longer (only where the model has one).
Subtle classes: bugs real engines shipped that move the distributions more than rounding does but keep each
row's order, so that they flip no argmax (only the distance test, whole.py, sees them):
- final_norm_eps: the output norm's epsilon multiplied by the strength, a per-row temperature (an engine that
  hard-codes the output norm's epsilon, or reads another key for it);
- logit_scale: the rows an engine returns multiplied by the strength (log-probabilities returned after a
  temperature: vLLM's "processed" logprobs);
- softcap: the rows soft-capped, strength * tanh(row / strength), where the model has no cap (Gemma 2's final
  logit soft-capping applied to another family, or left out of Gemma 2, as llama.cpp's and vLLM's first support
  did).
Engine-level classes:
- bos: the prompt's BOS left out (only where prompts start with one);
- rejected_key: every `strength` steps, the step's rejected draft (the runner-up token) keeps its key in the
  cache, at the position of the token accepted there, visible to every later row.
"""
import contextlib
from dataclasses import replace

import torch

from ..engine import generate
from ..model import RMSNorm
from . import forced

MODEL_CLASSES = ("rope_base", "rope_scaling", "norm_eps", "qk_norm", "window", "final_norm_eps")
ROWS = {"logit_scale": lambda rows, s: rows * s, "softcap": lambda rows, s: s * torch.tanh(rows / s)}
CLASSES = MODEL_CLASSES + ("bos", "rejected_key") + tuple(ROWS)
SUBTLE = ("final_norm_eps", "logit_scale", "softcap")



def applies(cls: str, model, prompt: list[int] | None = None) -> bool:
    a = model.args
    return {"rope_scaling": a.rope_scaling is not None, "qk_norm": a.qk_norm, "window": a.sliding_window is not None,
            "bos": len(prompt or []) > 1 and a.bos_id is not None and prompt[0] == a.bos_id}.get(cls, True)


@contextlib.contextmanager
def planted(model, cls: str, strength: float = 1.0):
    """The model with a model-level bug (MODEL_CLASSES) planted, restored on exit; engine-level classes pass
    the model through unchanged (their bug is in the decoding: decode)."""
    args, dev = model.args, model.embed.weight.device
    norms = [(m, m.eps) for m in model.modules() if isinstance(m, RMSNorm)]
    qk = [(layer.attn, layer.attn.q_norm, layer.attn.k_norm) for layer in model.layers]
    try:
        if cls == "rope_base":
            model.args = replace(args, rope_theta=args.rope_theta / strength)
        elif cls == "rope_scaling":
            model.args = replace(args, rope_scaling=None)
        elif cls == "window":
            model.args = replace(args, sliding_window=args.sliding_window + 1)
        elif cls == "norm_eps":
            for m, eps in norms:
                m.eps = eps * strength
        elif cls == "qk_norm":
            for attn, _, _ in qk:
                attn.q_norm, attn.k_norm = None, None
        elif cls == "final_norm_eps":
            model.norm.eps = model.norm.eps * strength
        model.init_rope(dev)
        yield model
    finally:
        model.args = args
        model.init_rope(dev)
        for m, eps in norms:
            m.eps = eps
        for attn, q, k in qk:
            attn.q_norm, attn.k_norm = q, k


def stale_keys(rows: torch.Tensor, every: int) -> dict[int, int]:
    """{i: the runner-up of row i} every `every` positions (from `every` on): rejected_key's stale keys."""
    return {i: int(rows[i].topk(2).indices[1]) for i in range(every, len(rows), every)}


def prompt_of(cls: str, prompt: list[int], model) -> list[int]:
    return prompt[1:] if cls == "bos" and applies("bos", model, prompt) else list(prompt)


@torch.no_grad()
def decode(model, prompt: list[int], max_new_tokens: int, cls: str | None = None, strength: float = 1.0,
           eos_id: int | None = None, rows: bool = False):
    """A planted engine's greedy output (cls None: a correct one, nanospec's fast mode); rows: also its logit rows
    (len, vocab), fp32, as an engine that returns rows would list them. rejected_key decodes by whole forwards over
    the sequence and its stale keys (forced.rows), a step at a time: small models."""
    eos = model.args.eos_id if eos_id is None else eos_id
    with planted(model, cls or "", strength):
        p = prompt_of(cls, prompt, model)
        if cls != "rejected_key":
            out = generate(model, p, max_new_tokens=max_new_tokens, eos_id=eos, record_logits=rows)
            return (out.tokens, returned(cls, strength, out.logits.float())) if rows else out.tokens
        tokens, stale, seen = [], {}, []
        while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != eos):
            row = forced.rows(model, p, tokens + [0], stale)[-1]
            i = len(tokens)
            if i and i % int(strength) == 0:
                stale[i] = int(row.topk(2).indices[1])
            tokens.append(int(row.argmax()))
            seen.append(row)
        return (tokens, torch.stack(seen)) if rows else tokens


@torch.no_grad()
def forced_rows(model, cls: str, strength: float, prompt: list[int], tokens: list[int],
                ref_rows: torch.Tensor) -> torch.Tensor:
    """The planted model's rows at the positions of `tokens` after `prompt`, teacher-forced (ref_rows: the
    reference's rows there, whose runner-ups are rejected_key's stale keys)."""
    with planted(model, cls, strength):
        if cls == "bos" and applies("bos", model, prompt):
            return forced.rows(model, prompt[1:], tokens)
        stale = stale_keys(ref_rows, int(strength)) if cls == "rejected_key" else None
        return returned(cls, strength, forced.rows(model, prompt, tokens, stale))


def returned(cls: str | None, strength: float, rows: torch.Tensor) -> torch.Tensor:
    """The rows as the engine returns them: transformed (ROWS: the order kept, so its tokens are the model's)."""
    return ROWS[cls](rows, strength) if cls in ROWS else rows
