"""Experiments that reproduce the papers' figures and tables, kept out of the method files.

    python -m nanospec.methods.analysis hidden_transfer        # Hidden Transfer's Figures 3, 4 and 7
    python -m nanospec.methods.analysis propd_grid             # ProPD's Table 2: early layer x top-k
    python -m nanospec.methods.analysis propd_grid --layers 2,4 --topk 5,10 --limit 20

Each takes --weights (default: the shipped model) and prints markdown tables (RESULTS.md holds
the measured ones). Layer sweeps are training runs: loop over `train.py --method hidden_transfer
--layers ...` and read each run's held-out accuracies (RESULTS.md lists the ones run).
"""
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import ArgumentParser, cli
from ..bench import bench, load_prompts
from ..io.checkpoint import load
from ..io.sources import base_of, resolve
from ..io.tokenizer import load_tokenizer
from ..training.data import distill_args
from ..training.forced import labelled
from ..training.loop import distilled
from . import load_drafter, propd
from .hidden_transfer import accuracy, load_transfer, ordered, pseudo_states
from .medusa import accuracy as medusa_accuracy
from .medusa import load_heads
from .medusa import samples as medusa_samples

DEFAULT = Path(__file__).resolve().parents[1] / "weights" / "pylm"


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


def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("experiment", choices=["hidden_transfer", "propd_grid"])
    p.add_argument("--weights", default=str(DEFAULT), help="the base model directory (with its drafters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-steps", type=int, default=400, help="hidden_transfer: early-exit head steps (0: skip)")
    p.add_argument("--early-rank", type=int, default=64, help="hidden_transfer: early-exit head rank")
    p.add_argument("--layers", default="2,4,6", help="propd_grid: early layers")
    p.add_argument("--topk", default="5,10,20,50", help="propd_grid: top-k values")
    p.add_argument("--limit", type=int, help="propd_grid: only the first N held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    distill_args(p)
    args = p.parse_args(argv)
    args.out = str(resolve(args.weights))
    {"hidden_transfer": hidden_transfer, "propd_grid": propd_grid}[args.experiment](args)
    return 0


if __name__ == "__main__":
    cli(main)
