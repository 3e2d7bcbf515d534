"""What every trainer shares: the LR schedule, the base model's states as data, progress lines,
resumable checkpoints."""
import time
from pathlib import Path

import torch

from .. import NanospecError
from ..cache import Block
from ..forward import context
from ..io.checkpoint import load
from ..io.files import atomic_write, hardware
from ..io.sources import base_of
from ..io.tokenizer import load_tokenizer
from ..model import Llama
from .data import chat_encoder, distill


def cosine_lr(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to peak, then cosine decay to floor * peak at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + torch.cos(torch.tensor(t * torch.pi)).item()))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)):
    """AdamW with decay on matrices only (not norms or 1-d gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def distilled(args):
    """What the drafter trainers start from: the frozen base model in args.out, on args.device, and its
    self-distillation data, every 10th sequence held out. Returns (model, train, held). A trainer's module and
    batches follow the model's device."""
    out = Path(args.out)
    base = base_of(out)  # the model's files (a drafters-only directory names its model in base.json)
    model = load(base, device=getattr(args, "device", "cpu"))
    for p in model.parameters():
        p.requires_grad_(False)
    data = distill(model, load_tokenizer(base), args.distill_prompts, args.new_tokens, chat=chat_encoder(base))
    train, n = [d for i, d in enumerate(data) if i % 10], getattr(args, "train_seqs", None)
    if n and n < len(train):  # spread evenly: the data is sorted by prompt length
        train = [train[i * len(train) // n] for i in range(n)]
    return model, train, data[::10]


def causal(tokens: torch.Tensor) -> Block:
    """A plain language-model block: row t at position t sees rows 0..t (a forward with cache=None)."""
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    return Block(tokens, pos, pos[0], pos + 1, torch.full((B, T, 1), -1, device=tokens.device))


@torch.no_grad()
def hidden_states(model: Llama, seqs: list[list[int]], layer: int | None = None, batch: int = 16) -> list[torch.Tensor]:
    """Every position's final normed state (with `layer`: the residual stream after that many
    layers) in every sequence: drafters' training data. Right padding is harmless: causal."""
    out = []
    for part in (seqs[i:i + batch] for i in range(0, len(seqs), batch)):
        T = max(map(len, part))
        blk = causal(torch.tensor([s + [0] * (T - len(s)) for s in part], device=model.embed.weight.device))
        ctx = context(model, blk, T, False)
        x = model.embed(blk.tokens)
        for L in model.layers[:layer]:
            x = L(x, ctx, None)
        h = model.norm(x) if layer is None else x
        out += [h[j, :len(s)] for j, s in enumerate(part)]
    return out


def update(opt, loss, lr: float, clip: float | None = 1.0, each: bool = False) -> None:
    """One optimizer step at learning rate lr: backward, clip the gradient norm (each: every
    parameter's on its own), step, zero."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    params = [p for g in opt.param_groups for p in g["params"]]
    if clip:
        for group in ([p] for p in params) if each else [params]:
            torch.nn.utils.clip_grad_norm_(group, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


class RankAccuracy:
    """acc[d][r]: how often depth d's rank-r candidate is the target, over held-out positions
    (label -100: nothing to predict there). Every drafter's trainer reports it, and the trees
    are chosen from it (tree.choose_tree)."""

    def __init__(self, depths: int, topk: int):
        self.hits, self.count, self.topk = torch.zeros(depths, topk), torch.zeros(depths), topk

    @torch.no_grad()
    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits (..., depths, V), labels (..., depths)."""
        top, labels = logits.topk(self.topk, dim=-1).indices, labels.to(logits.device)
        ok = labels != -100
        self.hits += ((top == labels[..., None]) & ok[..., None]).flatten(0, -3).sum(0).float().cpu()
        self.count += ok.flatten(0, -2).sum(0).float().cpu()

    def result(self) -> list[list[float]]:
        return (self.hits / self.count.clamp(min=1)[:, None]).tolist()


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Prints `step i/n | loss | lr | tokens/s | elapsed | eta` every `every` steps."""

    def __init__(self, steps: int, every: int, start_step: int = 0, elapsed: float = 0.0):
        self.steps, self.every, self.start = steps, every, start_step
        self.t0, self.prior = time.time(), elapsed  # prior: time spent before a resume
        self.tokens, self.loss = 0, None

    @property
    def elapsed(self) -> float:
        return self.prior + time.time() - self.t0

    def step(self, step: int, loss: float, lr: float, tokens: int, **extra) -> None:
        self.tokens += tokens
        self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        done = step + 1
        if done % self.every and done != self.steps:
            return
        run = time.time() - self.t0
        rate = self.tokens / max(run, 1e-9)
        eta = run / (done - self.start) * (self.steps - done)
        more = "".join(f" | {k} {v}" for k, v in extra.items())
        print(f"step {done}/{self.steps} | loss {self.loss:.4f} | lr {lr:.2e} | {rate:.0f} tok/s"
              f" | {fmt_time(self.elapsed)} elapsed | eta {fmt_time(eta)}{more}", flush=True)


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: torch.save(state, p))


def load_state(path: Path) -> dict | None:
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


class Checkpoint:
    """A trainer's checkpoint (the drafters' and the base model's): every `every` steps its module, optimizer,
    random streams and the time spent go to <--cache>/<name>.pt (atomically); with --resume the run continues
    from there, seeing the same batches it would have seen. The last step is saved too, so a resume with more
    steps than the run planned extends it, finished or not: its learning rate follows the new length's schedule
    from `start` on. config: what a resumed run must have been built with (a model's arguments); records: the
    run's own list (a held-out history), saved with the rest and refilled on a resume. args None: a run without
    checkpoints (a trainer called as a function).

    --time-limit S bounds the module's training steps to S seconds of this run: once PROBE steps after its first
    (which warms up: allocations, kernel choices) are timed, the run's length (`total`, the learning rate
    schedule's) is cut to what fits, so the schedule still ends at its floor; a run that slows down stops at S.
    The module is then saved as trained so far, and a --resume with more steps (or another limit) goes on."""
    PROBE = 10

    def __init__(self, args, name: str, module, opt, gens=(), every: int = 50, config: dict | None = None,
                 records: list | None = None):
        self.path = None if args is None else Path(args.cache) / f"{name}.pt"
        self.module, self.opt, self.gens = module, opt, gens
        self.every = getattr(args, "save_every", None) or every
        self.limit = getattr(args, "time_limit", None)
        self.config, self.records = config, records
        self.start, self.prior, self.prog, self.total = 0, 0.0, None, 0
        if getattr(args, "resume", False):
            state = load_state(self.path)
            if state is None:
                raise NanospecError(f"--resume: no checkpoint at {self.path}; run without --resume to start")
            if state.get("config") != config:
                raise NanospecError(f"--resume: the checkpoint at {self.path} was made with another model config")
            try:
                module.load_state_dict(state["module"])
                opt.load_state_dict(state["opt"])
            except (RuntimeError, ValueError, KeyError) as e:  # another shape (other options), or another format
                raise NanospecError(f"--resume: the checkpoint at {self.path} holds another module than this run "
                                    f"builds (other options?): {str(e).splitlines()[0]}") from None
            for g, s in zip(gens, state["gens"]):
                g.set_state(s)
            if records is not None:
                records[:] = state.get("records") or []
            self.start, self.prior, planned = state["step"], state.get("seconds", 0.0), state.get("steps")
            print(f"resumed from {self.path} at step {self.start}" + (f" of {planned}" if planned else ""), flush=True)

    def progress(self, steps: int, every: int) -> Progress:
        """The run's progress line, counting the time spent before a resume."""
        if self.start >= steps:
            print(f"the checkpoint is at step {self.start} and the run asks for {steps}: nothing is left to train, "
                  "so its weights are written as they are", flush=True)
        self.total = max(steps, self.start)
        self.prog = Progress(steps, every, start_step=self.start, elapsed=self.prior)
        return self.prog

    def steps(self):
        """The run's step indices, from `start` up to `total` (progress()'s steps, or fewer under --time-limit):
        read `total` for the schedule. Each step is checkpointed as the loop asks for the next (every `every`th,
        and the last)."""
        step, t0, t1 = self.start, time.time(), None
        while step < self.total:
            yield step
            step += 1
            if self.limit is not None:
                now, ran = time.time(), step - self.start
                t1 = now if ran == 1 else t1  # the timing starts after the first step
                if ran == self.PROBE + 1 and self.total > step:
                    fits = step + int((t0 + self.limit - now) * self.PROBE / max(now - t1, 1e-9))
                    if fits < self.total:
                        print(f"--time-limit {self.limit:g}s: {fits} steps fit, not {self.total}", flush=True)
                        self.total = self.prog.steps = max(fits, step)
                if now - t0 >= self.limit and step < self.total:
                    print(f"--time-limit {self.limit:g}s reached: stopping at step {step} of {self.total}",
                          flush=True)
                    self.total = self.prog.steps = step
            if self.path is not None and (step % self.every == 0 or step == self.total):
                save_state(self.path, {"module": self.module.state_dict(), "opt": self.opt.state_dict(),
                                       "gens": [g.get_state() for g in self.gens], "step": step,
                                       "steps": self.total, "seconds": self.prog.elapsed, "config": self.config,
                                       "records": self.records})

    def record(self) -> dict:
        """What a trained module's metadata says of its run: the steps it ran, the seconds they took and where."""
        device = next(self.module.parameters()).device
        return {"steps": self.total, "seconds": round(self.prog.elapsed), "hardware": hardware(device)}
