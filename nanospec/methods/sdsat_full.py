"""SDSAT as the paper trains it: every weight fine-tuned, the adaptive token a reserved vocabulary id.

Spec: Chengbo Liu, Yong Zhu, "SDSAT: Accelerating LLM Inference through Speculative Decoding with Semantic Adaptive
Tokens", 2024, arXiv:2403.18647 (section 2.2, appendix A). Decoding is sdsat.py's, on the
fine-tuned model (weights/<name>-sdsat/), which is therefore its own AR reference: lossless
means identical to it, not to the base model. decode.py switches to that directory for
`--method sdsat_full` and says so. The repository does not ship it (a whole copy of the
model's weights, where SmolLM2's update needs the room): `python train.py --method sdsat_full`
makes it (its cost is in RESULTS.md).

Kept beside sdsat.py's update, which leaves the base model's tokens bitwise untouched, because
with the same data and schedule the fine-tune drafts more per forward (RESULTS.md, "SDSAT without
touching the model"): it lets the standard tokens' keys and values carry what the adaptive tokens
need, which the update cannot change.

Choices where the paper is silent, and why:
- Adaptive token ids are the tokenizer's reserved ids (4..35 on the default model):
  <reserved_0> for identical tokens; with `--diverse` (appendix B), window position i gets
  <reserved_i>, and inference is limited to k <= L. SmolLM2's vocabulary has none to spare.
- Masking (section 2.2): each position starts a window with probability 0.1 (position 0
  never); the window length is uniform on 1..L; overlapping windows merge. An adaptive token at
  position i is labelled with the original token i+1, as at inference.
- The paper's rate (5e-5 to 1e-5 over 2000 steps at 4M tokens) is for 7B; the default model is
  fine-tuned at 3e-4 falling to 3e-5, with the base pretraining's batch of 8 x 512 tokens.
- Plain sequences are the base model's corpus (what protects its quality); mixed sequences are
  by default the base model's own greedy continuations of training prompts, the
  self-distillation data every other drafter here trains on. `--data corpus` uses corpus text.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import NanospecError
from ..forward import run
from ..io.checkpoint import load as load_model
from ..io.checkpoint import save
from ..io.files import atomic_write, fingerprint, hardware
from ..io.tokenizer import load_tokenizer
from ..training.data import distill, distill_args, token_stream
from ..training.loop import Checkpoint, adamw, causal, cosine_lr, update
from ..training.pretrain import eval_loss, val_windows, windows
from .sdsat import SDSAT


def model_dir(weights: Path) -> Path:
    """The SDSAT model for a weights directory: itself if it is one, else <weights>-sdsat."""
    weights = Path(weights)
    d = weights if (weights / "sdsat.json").is_file() else weights.with_name(weights.name + "-sdsat")
    if not (d / "sdsat.json").is_file():
        raise NanospecError(f"no SDSAT model at {d}: fine-tune one with python train.py --method sdsat_full "
                            f"--out {weights}")
    return d


class SDSATFull(SDSAT):
    """sdsat.py's decoding on the fine-tuned model, whose own vocabulary ids are the adaptive tokens."""
    name = "sdsat_full"
    floor = 2.4  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)
    model_dir = staticmethod(model_dir)

    @classmethod
    def load(cls, model, weights, k=5, width=1) -> "SDSATFull":
        meta = json.loads((model_dir(weights) / "sdsat.json").read_text())
        if meta["fingerprint"] != fingerprint(model):
            raise NanospecError(f"{model_dir(weights)} holds another model than the one loaded: sdsat_full decodes "
                                "its own fine-tuned weights")
        return cls(None, k, width, ids=meta["adaptive"])

    @classmethod
    def random(cls, model, seed=0) -> "SDSATFull":
        """A random model stands for its own fine-tune: its last vocabulary id is the adaptive token."""
        return cls(None, k=4, width=2, ids=[model.args.vocab_size - 1 - seed % 2])


# --- training ----------------------------------------------------------------------------------
def add_args(p):
    p.add_argument("--window", type=int, default=5, help="L: the longest run of adaptive tokens")
    p.add_argument("--mask-rate", type=float, default=0.1, help="chance that a position starts a window")
    p.add_argument("--diverse", action="store_true", help="a different adaptive token per window position")
    p.add_argument("--loss", default="improved", choices=["improved", "basic"], help="eq. 9 or eq. 8")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (half plain with --loss improved)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--eval-windows", type=int, default=0, help="held-out windows for the loss report (0: all)")
    p.add_argument("--max-files", type=int, help="use only the first N corpus files of each split (smoke tests)")
    p.add_argument("--data", default="distill", choices=["distill", "corpus"],
                   help="mixed sequences: the base model's own continuations, or corpus text")
    distill_args(p)


def mask(x: torch.Tensor, L: int, rate: float, ids: list[int], gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 2.2: windows of adaptive tokens in sequences x (B, T). A position starts a window
    with probability `rate` (position 0 never); its length is uniform on 1..L. Returns the mixed
    sequences and the (B, T) bool mask of replaced positions."""
    B, T = x.shape
    starts = (torch.rand(B, T, generator=gen) < rate).to(x.device)
    starts[:, 0] = False
    length = torch.randint(1, L + 1, (B, T), generator=gen).to(x.device)
    offset = torch.full_like(x, -1)  # each position's index inside the window covering it (-1: none)
    for i in range(L):  # windows starting i positions back that are longer than i
        cover = F.pad(starts & (length > i), (i, 0))[:, :T]
        offset = torch.where(cover & (offset < 0), i, offset)
    replaced = offset >= 0
    fill = torch.tensor(ids, device=x.device)[offset.clamp(min=0, max=len(ids) - 1)]  # diverse: by window position
    return torch.where(replaced, fill, x), replaced


def sdsat_loss(model, plain: torch.Tensor, mix: torch.Tensor, args, ids: list[int], gen):
    """Eq. 9 (improved: the plain sequences on every position, the mixed ones on their adaptive
    positions, w = 1) or eq. 8 (basic: every position of the mixed sequences; plain is unused).
    plain, mix (B, T+1): the sequences before masking. Returns (loss, standard-token loss of the
    mixed sequences: appendix A's curve)."""
    if args.loss == "basic":
        plain = plain[:0]
    x = torch.cat([plain, mix])
    inp, tgt = x[:, :-1], x[:, 1:]
    h = len(plain)
    mixed, replaced = mask(inp[h:], args.window, args.mask_rate, ids, gen)
    logits = run(model, causal(torch.cat([inp[:h], mixed]))).float()
    ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view(tgt.shape)
    mixed_ce = ce[h:]
    standard = mixed_ce[~replaced].mean()
    if args.loss == "basic":
        return mixed_ce.mean(), standard
    return 0.5 * (ce[:h].mean() + mixed_ce[replaced].sum() / replaced.sum().clamp(min=1)), standard


def train(args):
    base_dir = Path(args.out)
    out = base_dir.with_name(base_dir.name + "-sdsat")
    model = load_model(base_dir, torch.float32, args.device)
    tok = load_tokenizer(base_dir)
    ids = [tok.token_id(f"<reserved_{i}>") for i in range(args.window if args.diverse else 1)]  # the adaptive tokens
    if None in ids:
        raise NanospecError("sdsat_full's adaptive tokens are the tokenizer's reserved ones, and this model's "
                            "vocabulary has none to spare: train sdsat (an update that needs none) instead")
    base_fp = fingerprint(model)
    train_ids, val_ids = token_stream(tok, "train", args.max_files), token_stream(tok, "val", args.max_files)
    val = val_windows(val_ids, args.seq_len)
    if args.eval_windows:
        val = val[torch.randperm(len(val), generator=torch.Generator().manual_seed(0))[:args.eval_windows]]
    base_loss = eval_loss(model, val)
    mix_ids = train_ids
    if args.data == "distill":  # the base model's own continuations, as the other drafters train on
        data = [d for i, d in enumerate(distill(model, tok, args.distill_prompts, args.new_tokens)) if i % 10]
        mix_ids = np.array([t for p, c in data for t in p + c], dtype=train_ids.dtype)
    print(f"sdsat: fine-tuning {base_dir} ({args.loss} loss, L={args.window}, adaptive ids {ids}, mixed "
          f"sequences from {args.data}); "
          f"base held-out loss {base_loss:.4f} over {len(val)} windows", flush=True)
    opt = adamw(model, args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = Checkpoint(args, f"sdsat_full-{base_fp}", model, opt, [gen], every=20)
    prog = ckpt.progress(args.steps, every=10)
    model.train()
    for step in ckpt.steps():
        lr = cosine_lr(step, ckpt.total, args.lr, args.warmup)
        g = torch.Generator().manual_seed(args.seed * 7919 + step)
        half = args.batch_size // 2
        plain = windows(train_ids, half, args.seq_len, g).to(args.device)
        mix = windows(mix_ids, args.batch_size - half, args.seq_len, g).to(args.device)
        loss, standard = sdsat_loss(model, plain, mix, args, ids, gen)
        update(opt, loss, lr)
        prog.step(step, loss.item(), lr, args.batch_size * args.seq_len, standard=f"{standard.item():.4f}")
    save(model, out, dtype=torch.bfloat16, tokenizer_model=base_dir / "tokenizer.model")
    shipped = load_model(out, torch.float32, args.device)
    loss = eval_loss(shipped, val)
    if (base_dir / "prompts.jsonl").is_file():  # the benchmark's prompts travel with the model
        atomic_write(out / "prompts.jsonl", lambda p: p.write_text((base_dir / "prompts.jsonl").read_text()))
    meta = {"fingerprint": fingerprint(shipped), "base_fingerprint": base_fp, "adaptive": ids,
            "window": args.window, "mask_rate": args.mask_rate, "loss": args.loss, "data": args.data,
            "steps": ckpt.total,
            "held_out_loss": round(loss, 4), "base_held_out_loss": round(base_loss, 4), "eval_windows": len(val),
            "wall_time_s": round(prog.elapsed), "hardware": hardware(torch.device(args.device)),
            "command": "python " + " ".join(sys.argv)}
    atomic_write(out / "sdsat.json", lambda p: p.write_text(json.dumps(meta, indent=1) + "\n"))
    print(f"held-out loss on plain text: base {base_loss:.4f}, sdsat {loss:.4f} "
          f"({100 * (loss / base_loss - 1):+.2f}%). Wrote {out} in {prog.elapsed / 60:.1f} min", flush=True)
