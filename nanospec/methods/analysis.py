"""Experiments that reproduce the papers' figures and tables, kept out of the method files.

    python -m nanospec.methods.analysis hidden_transfer        # Hidden Transfer's Figures 3, 4 and 7
    python -m nanospec.methods.analysis propd_grid             # ProPD's Table 2: early layer x top-k
    python -m nanospec.methods.analysis propd_grid --layers 2,4 --topk 5,10 --limit 20
    python -m nanospec.methods.analysis heldout --weights weights/smollm2 --drafters weights/smollm2 run \
        --distill-prompts 2400 --also 1200            # drafters side by side on one held-out set

Each takes --weights (default: the shipped model) and prints markdown tables (RESULTS.md holds
the measured ones). Layer sweeps are training runs: loop over `train.py --method hidden_transfer
--layers ...` and read each run's held-out accuracies (RESULTS.md lists the ones run).
"""
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .. import DEFAULT_WEIGHTS, ArgumentParser, NanospecError, cli
from ..bench import bench, load_prompts
from ..io.checkpoint import load
from ..io.sources import base_of, resolve
from ..io.tokenizer import load_tokenizer
from ..training.data import chat_encoder, distill, distill_args, distill_prompts
from ..training.forced import labelled
from ..training.loop import distilled
from . import bita, load_drafter, propd, sdsat
from .hidden_transfer import accuracy, load_transfer, ordered, pseudo_states
from .medusa import accuracy as medusa_accuracy
from .medusa import load_heads
from .medusa import samples as medusa_samples


@torch.no_grad()
def similarity(model, tr, data, batch_size=8):
    """Figure 4: mean cosine similarity of each step's pseudo state to the real state of the
    token it stands for, after n = t_i..L layers (None below t_i) and after the final norm.
    Returns sims[n][step], n = 0..L, then the final norm's row."""
    L = len(model.layers)
    total, count = torch.zeros(L + 2, tr.k), torch.zeros(tr.k)
    for tokens, pos, vis, hosts, valid, teacher, _ in ordered(data, tr.k, "chain", batch_size):
        (B, k, H), T = valid.shape, tokens.shape[1] - tr.k * valid.shape[2]
        record = []
        record.append(pseudo_states(model, tr, tokens, pos, vis, hosts, record))
        idx = teacher.view(B, k * H, 1).expand(-1, -1, model.args.dim)
        for n, x in enumerate(record):
            cos = F.cosine_similarity(x[:, T:], x[:, :T].gather(1, idx), dim=-1).view(B, k, H)
            total[n] += (cos * valid).sum((0, 2))
        count += valid.sum((0, 2))
    sims = (total / count).tolist()
    return [[v if n >= t else None for v, t in zip(row, tr.layers)] for n, row in enumerate(sims)]


def hidden_transfer(args):
    """Figures 3, 4 and 7 on held-out data for the trained maps in args.out."""
    model, train_data, held = distilled(args)
    tr, meta = load_transfer(model, args.out)
    k, pct = tr.k, lambda a: f"{a[0]:.3f} / {sum(a[:5]):.3f}"
    print(f"hidden transfer at layers {tr.layers} (trained with the {meta['attention']} attention); "
          f"held-out top-1 / top-5 per step, {len(held)} sequences")
    rows = {"hidden transfer": accuracy(model, tr, held, "chain", 5),
            "hidden transfer, pseudo states masked from each other": accuracy(model, tr, held, "masked", 5)}
    items, train = [labelled(d) for d in held], [labelled(d) for d in train_data]
    if (Path(args.out) / "medusa.safetensors").is_file():
        heads, _ = load_heads(model, args.out)
        rows["medusa heads"] = medusa_accuracy(heads, *medusa_samples(model, items, len(heads.res)), 5)
    early = []
    for i, t in enumerate(tr.layers if args.early_steps else []):
        head = propd.train_early(model, train, t, args.early_steps, args.early_rank, ahead=i + 2, seed=args.seed)
        hits = propd.topk_hits(head, *propd.samples(model, items, t, ahead=i + 2), ks=(1, 5))
        early.append([hits[1], hits[5] - hits[1]])
    if early:
        rows["early exit (same layers)"] = early
    print("\nFigure 3: draft accuracy, top-1 / top-5")
    print("| drafter | " + " | ".join(f"step {i + 1} (t+{i + 2})" for i in range(k)) + " |")
    print("|---|" + "---|" * k)
    for name, acc in rows.items():
        print(f"| {name} | " + " | ".join(pct(a) for a in acc[:k]) + " |")
    print("\nFigure 4: cosine similarity of pseudo and real hidden states")
    print("| after layer | " + " | ".join(f"step {i + 1}" for i in range(k)) + " |")
    print("|---|" + "---|" * k)
    for n, row in enumerate(similarity(model, tr, held)):
        if n < tr.layers[0]:
            continue
        name = "final norm" if n > len(model.layers) else str(n)
        print(f"| {name} | " + " | ".join("" if v is None else f"{v:.3f}" for v in row) + " |")


def propd_grid(args):
    """Table 2: Medusa's static tree with early pruning only, per early layer and top-k, in one
    benchmark run (fast mode on the weights' held-out prompts)."""
    model = load(base_of(args.out))
    tok = load_tokenizer(base_of(args.out))
    prompts = [tok.encode(p) for p in load_prompts(Path(args.out) / "prompts.jsonl")[:args.limit]]
    specs = ["medusa"] + [f"propd:planner=static,layer={L},k={k}" for L in args.layers.split(",")
                          for k in args.topk.split(",")]
    results = bench(model, prompts, [load_drafter(s, model, args.out) for s in specs],
                    max_new_tokens=args.max_new_tokens)
    base = results[0]["mean_accepted"]
    print(f"\nmedusa alone: {base:.3f} tokens/step, {results[0]['speedup']:.3f}x\n")
    print("| layer | top-k | rows pruned | tokens/step | vs Medusa | speedup |\n|---|---|---|---|---|---|")
    for spec, r in zip(specs[1:], results[1:]):
        opts = dict(kv.split("=") for kv in spec.split(":")[1].split(","))
        pruned = r['notes'].split('(')[1].split(')')[0]
        print(f"| {opts['layer']} | {opts['k']} | {pruned} | {r['mean_accepted']:.3f} | "
              f"{100 * (r['mean_accepted'] / base - 1):+.1f}% | {r['speedup']:.3f}x |")


TRAINED = ("medusa", "hidden_transfer", "bita", "sdsat")  # the drafters heldout measures


def held_out(model, tok, n: int, new_tokens: int, also=(), chat=None) -> list:
    """The (prompt, continuation) pairs held out of a run on n distilled prompts (every 10th), less any whose
    prompt trained a run on one of `also`'s prompt counts: a set held out of all of them."""
    held = distill(model, tok, n, new_tokens, chat=chat)[::10]
    for m in also:
        trained = {tuple(p) for i, p in enumerate(distill_prompts(tok, m, chat)) if i % 10}
        held = [d for d in held if tuple(d[0]) not in trained]
    return held


def drafter_accuracy(model, weights, method: str, held: list) -> list[list[float]] | None:
    """acc[d][r] of one drafters directory's `method` on held-out pairs: rank r's hit rate at token t+2+d, as
    each trainer measures it (None: the directory has no such drafter)."""
    if not (Path(weights) / f"{method}.safetensors").is_file():
        return None
    if method == "medusa":
        heads, _ = load_heads(model, weights)
        return medusa_accuracy(heads, *medusa_samples(model, [labelled(d) for d in held], heads.K), topk=5)
    if method == "hidden_transfer":
        return accuracy(model, load_transfer(model, weights)[0], held, "chain", topk=5)
    if method == "bita":
        items, opts = [labelled(d) for d in held], SimpleNamespace(batch_size=8, groups=32)  # its trainer's
        return bita.accuracy(model, bita.BiTA.load(model, weights).tune, items, opts)
    delta, meta = sdsat.load_delta(model, weights)
    return sdsat.accuracy(model, delta, held, SimpleNamespace(window=meta["window"], diverse=meta["tokens"] > 1))


@torch.no_grad()
def heldout(args):
    """The trained drafters of each --drafters directory on one held-out set (held_out: --distill-prompts' held-out
    sequences, less those that trained a run on --also's counts): top-1 / top-5 at tokens t+2.. The accuracy half
    of the shipping rule; a bench is the other."""
    methods = args.methods.split(",")
    if not set(methods) <= set(TRAINED):
        raise NanospecError(f"heldout --methods: choose from {', '.join(TRAINED)}, not {args.methods!r}")
    missing = [d for d in args.drafters or [] if not any((Path(d) / f"{m}.safetensors").is_file() for m in methods)]
    if missing:
        raise NanospecError(f"heldout --drafters {missing[0]}: no {', '.join(methods)} drafter there")
    base = base_of(args.out)
    model, tok = load(base), load_tokenizer(base)
    held = held_out(model, tok, args.distill_prompts, args.new_tokens, args.also, chat_encoder(base))
    print(f"{len(held)} held-out sequences ({args.distill_prompts} prompts' every 10th"
          + (f", less those that trained runs on {', '.join(map(str, args.also))}" if args.also else "") + ")\n")
    print("| drafters | method | top-1 / top-5 at t+2, t+3, ... |\n|---|---|---|")
    for weights in args.drafters or [args.out]:
        for method in methods:
            acc = drafter_accuracy(model, weights, method, held)
            if acc is not None:
                print(f"| {weights} | {method} | " + ", ".join(f"{a[0]:.3f} / {sum(a[:5]):.3f}" for a in acc) + " |",
                      flush=True)


def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("experiment", choices=["hidden_transfer", "propd_grid", "heldout"])
    p.add_argument("--weights", default=str(DEFAULT_WEIGHTS), help="the base model directory (with its drafters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-steps", type=int, default=400, help="hidden_transfer: early-exit head steps (0: skip)")
    p.add_argument("--early-rank", type=int, default=64, help="hidden_transfer: early-exit head rank")
    p.add_argument("--layers", default="2,4,6", help="propd_grid: early layers")
    p.add_argument("--topk", default="5,10,20,50", help="propd_grid: top-k values")
    p.add_argument("--limit", type=int, help="propd_grid: only the first N held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", nargs="+", help="heldout: drafters directories (default: --weights)")
    p.add_argument("--methods", default=",".join(TRAINED), help="heldout: the drafters to measure")
    p.add_argument("--also", type=int, nargs="*", default=[],
                   help="heldout: leave out sequences that trained a run on these prompt counts")
    distill_args(p)
    args = p.parse_args(argv)
    args.out = str(resolve(args.weights))
    {"hidden_transfer": hidden_transfer, "propd_grid": propd_grid, "heldout": heldout}[args.experiment](args)
    return 0


if __name__ == "__main__":
    cli(main)
