"""Teacher forcing: another engine's tokens run through a nanospec model, and every position scored.

The reference (nanospec in fp32) reads the prompt and the other engine's output in one forward, so that each of
the engine's tokens meets the reference's row for the same prefix, wherever the two outputs have parted. A
position's scores:
- flip: the engine's token is not the reference row's argmax;
- margin: the reference's top logit minus its logit for the engine's token (0 where they agree), in logits;
- gap: the reference row's top-2 gap (how far a perturbation must move the row to flip it there);
- where the engine returned its own rows (top-k logits, or log-probabilities: a row's log-sum-exp cancels), the
  KL divergence of the engine's distribution from the reference's over the engine's listed tokens (both
  renormalized over that set) and whether the engine's top-N ids are the reference's (N: the ids it listed,
  at most TOP_N).
"""
import torch

from ..forward import run
from ..training.loop import causal

TOP_N = 5


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


def score(ref_rows: torch.Tensor, tokens: list[int], engine: list[dict] | None = None, agree: int = 0) -> dict:
    """One prompt's scores (module docstring) from the reference's rows at the engine's tokens. engine: the
    engine's own rows as trace positions (top_ids, top_logits), if it returned any; agree: the first positions
    known to be the reference's own tokens (a trace's common prefix): no flip there, whatever the forward's
    rounding says."""
    n = min(len(tokens), len(ref_rows))
    r = ref_rows[:n].float()
    top2 = r.topk(min(2, r.shape[-1]), -1)
    tok = torch.tensor(tokens[:n], dtype=torch.long)
    margin = (top2.values[:, 0] - r.gather(1, tok[:, None])[:, 0]).clamp(min=0)
    flips = tok != top2.indices[:, 0]
    flips[:agree], margin[:agree] = False, 0.0
    out = {"positions": n, "flips": [[int(i), float(margin[i])] for i in flips.nonzero()[:, 0]],
           "gaps": (top2.values[:, 0] - top2.values[:, -1]).tolist()}
    if engine:
        kls, same = [], 0
        for i, e in enumerate(engine[:n]):
            kls.append(restricted_kl(r[i], e["top_ids"], e["top_logits"]))
            k = min(TOP_N, len(e["top_ids"]))
            same += set(e["top_ids"][:k]) == set(r[i].topk(k).indices.tolist())
        out.update(kl=kls, top_n_same=same)
    return out


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
        scores.append(score(rows(model, o["prompt_ids"], o["output_ids"]), o["output_ids"], rowed, agree))
    return scores
