"""Teacher forcing: another engine's tokens run through a nanospec model, and every position scored.

The reference (nanospec in fp32) reads the prompt and the other engine's output in one forward, so that each of
the engine's tokens meets the reference's row for the same prefix, wherever the two outputs have parted. A
position's scores:
- flip: the engine's token is not the reference row's argmax;
- margin: the reference's top logit minus its logit for the engine's token (0 where they agree), in logits;
- gap: the reference row's top-2 gap (how far a perturbation must move the row to flip it there);
- where the engine returned its own rows (top-k logits, or log-probabilities: a row's log-sum-exp cancels), its
  distances (distances()): at each k of KS it lists, the KL divergence of the engine's distribution from the
  reference's over the engine's top k ids (both renormalized over that set), and whether the engine's top-N ids
  are the reference's (N = min(k, TOP_N)). The noise (noise.py) keeps the same distances, computed the same way
  at the same k, so that whole.py compares like with like.
"""
import hashlib
import json

import torch

from ..forward import run
from ..training.loop import causal

TOP_N = 5
KS = (2, 5, 8, 20)  # the truncations at which distances are kept: an engine listing k ids is judged at the
#                     largest of these <= k (OpenAI-style servers list 5, traces 8, vLLM up to 20)
KL_FLOOR = 1e-5  # a position's KL below this (nats) reads as this: fp32 kernels' rounding (about 1e-10) stays
#                  under it, and no engine bug of consequence moves a distribution by less


@torch.no_grad()
def rows(model, prompt: list[int], tokens: list[int], stale: dict[int, int] | None = None) -> torch.Tensor:
    """The model's logit rows (len(tokens), vocab), fp32, for each of `tokens` after `prompt`: row i is the one
    tokens[i] is read from. stale {i: token}: a key left in the cache (a rejected draft's), at the position of
    tokens[i], visible to tokens[i] and every row after it (plants.py's speculative-decoding bug)."""
    seq, pos, real = [], [], []
    for j, t in enumerate(list(prompt) + list(tokens)):
        i = j - len(prompt)
        if stale and i in stale:
            seq.append(stale[i])
            pos.append(j)
        seq.append(t)
        pos.append(j)
        real.append(len(seq) - 1)
    dev = model.embed.weight.device
    block = causal(torch.tensor([seq], device=dev))  # row r sees rows 0..r; positions may repeat
    block.pos = torch.tensor([pos], device=dev)
    out = run(model, block)[0].float()  # (R, V)
    at = torch.tensor(real[len(prompt) - 1:len(prompt) - 1 + len(tokens)], device=dev)
    return out.index_select(0, at).cpu()


def restricted_kl(ref: torch.Tensor, ids: list[int], values: list[float]) -> float:
    """KL(engine || reference) over the engine's listed ids, both distributions renormalized over them."""
    if len(ids) < 2:
        return 0.0
    p = torch.log_softmax(torch.tensor(values, dtype=torch.float64), 0)
    q = torch.log_softmax(ref[ids].double(), 0)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def listed(position: dict) -> list[tuple[int, float]]:
    """An engine's listed (id, logit or log-probability) pairs, largest first (ties by id)."""
    return sorted(zip(position["top_ids"], position["top_logits"]), key=lambda a: (-a[1], a[0]))


def distances(ref, engine: list[dict]) -> dict[str, dict]:
    """{str(k): {"kl": [...], "same": [...]}} per position, at each k of KS that every position lists: ref, the
    reference's rows (n, vocab), or its trace positions (top-k ids and logits: an id it does not list reads as its
    last listed logit, an upper bound); engine, the engine's positions."""
    n = min(len(ref), len(engine))
    pairs = [listed(e) for e in engine[:n]]
    out = {}
    for k in (k for k in KS if n and all(len(p) >= k for p in pairs)):
        kls, same = [], []
        for i in range(n):
            ids, vals = [a[0] for a in pairs[i][:k]], [a[1] for a in pairs[i][:k]]
            if isinstance(ref[i], dict):
                known = dict(zip(ref[i]["top_ids"], ref[i]["top_logits"]))
                row_ids = sorted(known, key=lambda t: -known[t])
                ref_vals = torch.tensor([known.get(t, ref[i]["top_logits"][-1]) for t in ids])
            else:
                row_ids, ref_vals = ref[i].topk(min(TOP_N, k)).indices.tolist(), ref[i][ids]
            kls.append(max(KL_FLOOR, restricted_kl(ref_vals, list(range(len(ids))), vals)))
            top = min(TOP_N, k)
            same.append(int(set(ids[:top]) == set(row_ids[:top])))
        out[str(k)] = {"kl": [float(f"{x:.4g}") for x in kls], "same": same}
    return out


def score(ref_rows: torch.Tensor, tokens: list[int], engine: list[dict] | None = None, agree: int = 0,
          key: str | None = None) -> dict:
    """One prompt's scores (module docstring) from the reference's rows at the engine's tokens. engine: the
    engine's own rows as trace positions (top_ids, top_logits), if it returned any; agree: the first positions
    known to be the reference's own tokens (a trace's common prefix): no flip there, whatever the forward's
    rounding says; key: the prompt's (prompt_key), which pairs it with the noise's sample of the same prompt."""
    n = min(len(tokens), len(ref_rows))
    r = ref_rows[:n].float()
    top2 = r.topk(min(2, r.shape[-1]), -1)
    tok = torch.tensor(tokens[:n], dtype=torch.long)
    margin = (top2.values[:, 0] - r.gather(1, tok[:, None])[:, 0]).clamp(min=0)
    flips = tok != top2.indices[:, 0]
    flips[:agree], margin[:agree] = False, 0.0
    out = {"positions": n, "flips": [[int(i), float(margin[i])] for i in flips.nonzero()[:, 0]],
           "gaps": (top2.values[:, 0] - top2.values[:, -1]).tolist(), "key": key}
    if engine:
        out["distances"] = distances(r, engine[:n])
        out["movements"] = movements(top2.indices, top2.values, engine[:n])
    return out


def movements(ids: torch.Tensor, vals: torch.Tensor, engine: list[dict]) -> list[float]:
    """How far the engine moved the reference's top-2 gap, at the positions where it lists both ids (a noise
    model's movements, noise.py, when a run serves as another's noise)."""
    out = []
    for (a, c), (va, vc), e in zip(ids.tolist(), vals.tolist(), engine):
        got = dict(zip(e["top_ids"], e["top_logits"]))
        if a in got and c in got:
            out.append(abs((va - vc) - (got[a] - got[c])))
    return out


def prompt_key(prompt_ids: list[int]) -> str:
    """A short name for a prompt, the same in a run's scores and in a noise sample."""
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def score_run(model, refs: list[dict] | None, others: list[dict]) -> list[dict]:
    """Every output of a run scored against `model` (nanospec fp32). refs: the reference's traces of the same
    prompts (AR's own tokens): up to the first difference the engine's tokens are known to be AR's."""
    index = {tuple(r["prompt_ids"]): r for r in refs or []}
    scores = []
    for o in others:
        if not o["output_ids"]:
            continue
        ref = index.get(tuple(o["prompt_ids"]))
        agree = first_difference(ref["output_ids"], o["output_ids"]) if ref else 0
        rowed = o.get("positions") if all("top_ids" in p for p in o.get("positions", [{}])) else None
        scores.append(score(rows(model, o["prompt_ids"], o["output_ids"]), o["output_ids"], rowed, agree,
                            prompt_key(o["prompt_ids"])))
    return scores


def score_echo(model, entries: list[dict]) -> list[dict]:
    """An engine's rows at the reference's own tokens (a server's echo), scored as a noise sample is: the engine's
    token at a position is its own top id there, and both sides read the same prefix at every position."""
    return [score(rows(model, e["prompt_ids"], e["output_ids"]), [listed(p)[0][0] for p in e["positions"]],
                  e["positions"], 0, prompt_key(e["prompt_ids"])) for e in entries if e["output_ids"]]
