"""Pretraining the default model, a small GQA Llama, on the stdlib corpus (nanospec/data.py).

    python train.py --method tokenizer            # weights/pylm/tokenizer.model
    python train.py --method base [--resume]      # weights/pylm/{config.json,model.safetensors}

AdamW (0.9, 0.95), weight decay 0.1 on matrices, linear warmup then cosine to 10%,
gradient clipping at 1.0. Batches are random windows of the training stream, drawn
from a generator seeded by (seed, step), so a resumed run sees the same batches.
The shipped weights are stored in bfloat16 (upcasting to fp32 at load is exact);
the final held-out figures are measured on those stored weights, next to a
smoothed bigram baseline on the same windows, and written to training.json.
"""
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..forward import run
from ..io.checkpoint import load, save
from ..io.files import atomic_write, hardware
from ..io.tokenizer import Tokenizer, train_tokenizer
from ..model import Llama, ModelArgs
from .data import STDLIB, documents, split_bytes, token_stream
from .loop import Checkpoint, adamw, causal, cosine_lr, update


def add_args(p):
    p.add_argument("--vocab-size", type=int, default=8192, help="tokenizer")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--tokenizer", help="tokenizer.model to use (default: OUT/tokenizer.model)")
    p.add_argument("--max-files", type=int, help="use only the first N files of each split (smoke tests)")


def train_tok(args):
    out = Path(args.out)
    texts = (text for _, text in documents("train", max_files=args.max_files))
    t0 = time.time()
    blob = train_tokenizer(texts, args.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "tokenizer.model", lambda p: p.write_bytes(blob))
    tok = Tokenizer(out / "tokenizer.model")
    sample = documents("val", max_files=20)
    n_bytes = sum(len(t.encode()) for _, t in sample)
    n_tok = sum(len(tok.encode(t, bos=False)) for _, t in sample)
    print(f"wrote {out / 'tokenizer.model'}: {tok.vocab_size} ids in {time.time() - t0:.0f}s; "
          f"{n_bytes / n_tok:.2f} bytes/token on held-out files")


def windows(stream: np.ndarray, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """B random windows of T+1 tokens."""
    starts = torch.randint(0, len(stream) - T - 1, (B,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s:s + T + 1] for s in starts]).astype(np.int64))


def val_windows(stream: np.ndarray, T: int) -> torch.Tensor:
    """Non-overlapping windows of T+1 tokens covering the stream."""
    n = (len(stream) - 1) // T
    return torch.from_numpy(np.stack([stream[i * T:i * T + T + 1] for i in range(n)]).astype(np.int64))


@torch.no_grad()
def eval_loss(model, wins: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token loss in nats over all predicted positions of the windows."""
    model.eval()
    total, count = 0.0, 0
    dev = model.embed.weight.device
    for i in range(0, len(wins), batch):
        x = wins[i:i + batch].to(dev)
        logits = run(model, causal(x[:, :-1]))
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def bigram_loss(train: np.ndarray, wins: torch.Tensor, V: int) -> float:
    """Held-out loss of a bigram model with Dirichlet smoothing toward the unigram:
    P(b|a) = (c(a,b) + beta * P(b)) / (c(a) + beta); the best beta of a small grid is
    reported (a baseline given every benefit of the doubt)."""
    tr = train.astype(np.int64)
    pairs = np.bincount(tr[:-1] * V + tr[1:], minlength=V * V)
    uni = (np.bincount(tr, minlength=V) + 1) / (len(tr) + V)
    ctx = np.bincount(tr[:-1], minlength=V)
    a, b = wins[:, :-1].flatten().numpy(), wins[:, 1:].flatten().numpy()
    best = math.inf
    for beta in (1, 3, 10, 30, 100):
        p = (pairs[a * V + b] + beta * uni[b]) / (ctx[a] + beta)
        best = min(best, float(-np.log(p).mean()))
    return best


def train_base(args):
    out = Path(args.out)
    tok_file = Path(args.tokenizer or out / "tokenizer.model")
    tok = Tokenizer(tok_file)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    margs = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab_size=tok.vocab_size, intermediate_size=args.intermediate_size, tie_embeddings=True,
                      max_seq_len=2048, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    train_ids = token_stream(tok, "train", args.max_files)
    val_ids = token_stream(tok, "val", args.max_files)
    T, B = args.seq_len, args.batch_size
    val_all = val_windows(val_ids, T)
    val_quick = val_all[torch.randperm(len(val_all), generator=torch.Generator().manual_seed(0))[:32]]
    print(f"corpus: {len(train_ids):,} train tokens, {len(val_ids):,} held-out tokens "
          f"({len(val_all)} windows of {T})", flush=True)

    model = Llama(margs).to(dev)
    for name, p in model.named_parameters():  # GPT-2 style init; residual outputs scaled by depth
        std = 0.02 / math.sqrt(2 * margs.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        torch.nn.init.normal_(p, std=std) if p.dim() == 2 else None
    opt = adamw(model, args.lr, weight_decay=0.1)
    history = []  # held-out losses along the run: training.json's
    ckpt = Checkpoint(args, f"{out.name}-base", model, opt, config=vars(margs), records=history)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {margs.n_layers} layers, dim {margs.dim}, "
          f"{margs.n_heads}/{margs.kv_heads} heads; {args.steps} steps of {B}x{T} tokens", flush=True)

    prog = ckpt.progress(args.steps, every=10)
    model.train()
    for step in ckpt.steps():
        lr = cosine_lr(step, ckpt.total, args.lr, args.warmup)
        x = windows(train_ids, B, T, torch.Generator().manual_seed(args.seed * 1_000_003 + step)).to(dev)
        logits = run(model, causal(x[:, :-1]))
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, B * T)
        done = step + 1
        if done % args.eval_every == 0 or done == ckpt.total:
            vl = eval_loss(model, val_quick)
            history.append({"step": done, "train_loss": round(prog.loss, 4), "val_loss": round(vl, 4)})
            print(f"step {done}: held-out loss {vl:.4f} (32 windows)", flush=True)
    wall = prog.elapsed

    save(model, out, dtype=torch.bfloat16, tokenizer_model=tok_file)
    shipped = load(out, torch.float32, dev)  # measure what ships: the bf16 weights, upcast
    n_bytes = split_bytes("val", args.max_files)
    loss = eval_loss(shipped, val_all)
    bigram = bigram_loss(train_ids, val_all, tok.vocab_size)
    bpb = lambda nats: nats * (len(val_ids) - 1) / math.log(2) / n_bytes  # tokens per byte x bits per token
    report = {
        "command": "python " + " ".join(sys.argv), "python": platform.python_version(),
        "torch": torch.__version__, "stdlib": str(STDLIB),
        "hardware": hardware(dev),
        "wall_time_s": round(wall), "steps": ckpt.total, "tokens_seen": ckpt.total * B * T,
        "parameters": n_params, "train_tokens": len(train_ids), "val_tokens": len(val_ids),
        "val_bytes": n_bytes, "val_loss_nats": round(loss, 4), "val_bits_per_byte": round(bpb(loss), 4),
        "bigram_val_loss_nats": round(bigram, 4), "bigram_bits_per_byte": round(bpb(bigram), 4),
        "history": history,
    }
    atomic_write(out / "training.json", lambda p: p.write_text(json.dumps(report, indent=1) + "\n"))
    print(f"held-out: {loss:.4f} nats/token, {bpb(loss):.3f} bits/byte; bigram baseline {bigram:.4f} "
          f"nats/token, {bpb(bigram):.3f} bits/byte. Wrote {out} in {wall / 60:.1f} min", flush=True)
