"""Detection floors: the smallest planted bug of each class (plants.py) that a noise model still flags.

Each class is planted at increasing strength in the model under test (at the dtype its noise was measured in),
teacher-forced over the reference's sequences, and its rows scored against the reference's (forced.score: the
planted model's argmax as the engine's token) and judged by whole.test against the noise, twice: from its ids
alone, and with its top rows (forced.KS's largest), as an engine that returns rows is judged. A class's floor is
the weakest strength flagged, found by bisection over its ladder (STRENGTHS, weakest first; a stronger bug flags
at least as surely); classes that the model does not have (a rope_scaling, q/k norms, a window, a BOS) are
reported as such.
"""
import torch

from . import forced, noise, plants, whole

STRENGTHS = {"rope_base": [1.001, 1.003, 1.01, 1.03, 1.1, 1.3, 2.0, 4.0, 10.0],
             "norm_eps": [10.0, 100.0, 1e3, 1e4, 1e5, 1e6],
             "rejected_key": [64, 32, 16, 8, 4, 2],
             "final_norm_eps": [1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9],
             "logit_scale": [1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0],
             "softcap": [800.0, 400.0, 200.0, 100.0, 50.0, 20.0, 10.0]}
LABELS = {"rope_base": "rope base /{:g}", "norm_eps": "eps x{:g}", "rejected_key": "rejected key every {:g} steps",
          "rope_scaling": "rope scaling left out", "qk_norm": "q/k norm left out",
          "window": "window one key longer", "bos": "BOS left out", "final_norm_eps": "output norm eps x{:g}",
          "logit_scale": "logits x{:g}", "softcap": "soft cap {:g}"}


def flagged(got: list, paths: list[tuple], nz: dict, alpha: float, rows: bool) -> bool:
    """Whether a planted model's rows (got, per path) are a divergence against the noise, from ids alone or with
    rows; paths: (prompt, tokens, ref_rows)."""
    scores = [forced.score(ref, g.argmax(-1).tolist(), noise.positions_of(g, max(forced.KS)) if rows else None, 0,
                           forced.prompt_key(prompt)) for g, (prompt, _, ref) in zip(got, paths)]
    return whole.test(scores, nz, alpha)["verdict"] == "divergence"


def floors(model, reference, entries: list[dict], nz: dict, alpha: float = whole.ALPHA) -> dict:
    """{class: {"ids": label of its floor from ids alone, "rows": with rows}, or "n/a" where the model lacks the
    class}; model: the planted model (the noise's dtype), reference: nanospec fp32, entries: the reference's traces
    (their sequences are forced)."""
    entries = [e for e in entries if e["output_ids"]]
    with torch.no_grad():
        paths = [(e["prompt_ids"], e["output_ids"], forced.rows(reference, e["prompt_ids"], e["output_ids"]))
                 for e in entries]
    out = {}
    for cls in plants.CLASSES:
        if not plants.applies(cls, model, entries[0]["prompt_ids"] if entries else None):
            out[cls] = "n/a"
            continue
        planted = {}  # strength: the planted model's rows per path, forced once for both judgements

        def rows_at(strength):
            if strength not in planted:
                planted[strength] = [plants.forced_rows(model, cls, strength, *path) for path in paths]
            return planted[strength]
        out[cls] = {how: floor(cls, lambda s: flagged(rows_at(s), paths, nz, alpha, how == "rows"))
                    for how in ("ids", "rows")}
    return out


def floor(cls: str, is_flagged) -> str:
    """The label of the weakest strength of cls's ladder that is_flagged(strength), by bisection."""
    ladder = STRENGTHS.get(cls, [1.0])
    lo, hi = 0, len(ladder)  # the weakest flagged is in ladder[lo:hi], or none (hi == len)
    while lo < hi:
        mid = (lo + hi) // 2
        if is_flagged(ladder[mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(ladder):
        return f"not flagged up to {LABELS[cls].format(ladder[-1])}" if cls in STRENGTHS else \
            f"{LABELS[cls]}: not flagged"
    return LABELS[cls].format(ladder[lo])


def describe(found: dict, source: str) -> str:
    absent = [LABELS[k].removesuffix(" left out").removesuffix(" one key longer") for k, v in found.items()
              if v == "n/a"]
    shown = [v["ids"] if v["ids"] == v["rows"] else f"{v['ids']} (with rows: {v['rows']})"
             for v in found.values() if v != "n/a"]
    return (f"  detection floor ({source}), from ids: " + ", ".join(shown)
            + (f" (not in this model or its prompts: {', '.join(absent)})" if absent else ""))


AT = {"rope_base": 1.5, "norm_eps": 1e3, "rejected_key": 16, "final_norm_eps": 1e7, "logit_scale": 1.1,
      "softcap": 100.0, "rope_scaling": 1.0, "qk_norm": 1.0, "window": 1.0, "bos": 1.0}  # main()'s strengths


def main(argv=None) -> None:
    """Each class on a model: its fp32 flips and mean KL (top 20) over the fp32 greedy sequences of the prompts at the
    strength AT names, against the noise of a dtype, and its floors from ids and with rows, planted in fp32.

        python -m nanospec.oracle.floors --weights weights/smollm2 --prompts FILE.jsonl --limit 8 --max-new-tokens 64
    """
    from .. import DEFAULT_WEIGHTS, ArgumentParser
    from ..bench import load_prompts
    from ..engine import generate
    from ..io.checkpoint import DTYPES, load
    from ..io.sources import base_of, resolve
    from ..io.tokenizer import load_tokenizer
    p = ArgumentParser(description=main.__doc__)
    p.add_argument("--weights", default=str(DEFAULT_WEIGHTS))
    p.add_argument("--prompts", help="JSONL of {\"prompt\": ...} (default: the weights' prompts.jsonl)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the noise's dtype")
    args = p.parse_args(argv)
    weights = resolve(args.weights)
    fp32, model = load(base_of(weights)), load(base_of(weights), DTYPES[args.dtype])
    texts = load_prompts(args.prompts or weights / "prompts.jsonl")[:args.limit]
    prompts = [load_tokenizer(base_of(weights)).encode(t) for t in texts]
    entries = [{"prompt_ids": q, "output_ids": generate(fp32, q, max_new_tokens=args.max_new_tokens).tokens}
               for q in prompts]
    nz = noise.measure(fp32, model, entries, False, f"nanospec {args.dtype} vs float32")
    ref = [forced.rows(fp32, e["prompt_ids"], e["output_ids"]) for e in entries]

    def flips_kl(rows: list) -> tuple[int, float]:
        k = max(forced.KS)
        kls = [x for r, g in zip(ref, rows) for x in forced.distances(r, noise.positions_of(g, k))[str(k)]["kl"]]
        return sum(int((g.argmax(-1) != r.argmax(-1)).sum()) for r, g in zip(ref, rows)), sum(kls) / len(kls)
    n, (f0, kl0) = sum(len(r) for r in ref), flips_kl([forced.rows(model, e["prompt_ids"], e["output_ids"]).float()
                                                       for e in entries])
    print(f"{args.dtype} rounding: {f0} flips in {n} positions, mean KL {kl0:.3g}")
    found = floors(fp32, fp32, entries, nz)
    for cls in plants.CLASSES:
        if found[cls] == "n/a":
            print(f"{cls}: not in this model or its prompts")
            continue
        f, kl = flips_kl([plants.forced_rows(fp32, cls, AT[cls], e["prompt_ids"], e["output_ids"], r)
                          for e, r in zip(entries, ref)])
        print(f"{cls} at {AT[cls]:g}: {f} flips, mean KL {kl:.3g} (x{kl / kl0:.3g} {args.dtype}'s); floor against "
              f"{args.dtype} noise, planted in fp32: {found[cls]['ids']} from ids, {found[cls]['rows']} with rows")


if __name__ == "__main__":
    from .. import cli
    cli(main)
