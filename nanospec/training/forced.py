"""Self-distillation by teacher forcing: the base model run over real text in long windows, its own argmax at every
position the label.

A forward sees a whole window at once (prefill speed), so this labels positions many times faster than generating
them token by token (data.distill). A drafter learns what the model would emit: where the text goes on as the model
would (each next token the model's argmax), the token k ahead is the model's own (`targets`).

The corpus: the interpreter's English help topics (pydoc_data), then training-split files of the stdlib's code spread
evenly over the split. No held-out file (the held-out prompts' source) is read. Cached by the base weights'
fingerprint.

    python -m nanospec.training.forced --weights weights/smollm2 --positions 1000000   # make (and cache) the data
"""
import time

import numpy as np
import torch

from .. import ArgumentParser, check_device, cli
from ..forward import run
from ..io.files import atomic_write, fingerprint
from ..io.sources import base_of
from ..io.tokenizer import load_tokenizer
from .data import CACHE, corpus_files, documents, split_of
from .loop import causal, fmt_time


def corpus(tok, tokens: int) -> np.ndarray:
    """About `tokens` tokens of text, each document BOS text EOS: the help topics, then training files."""
    from pydoc_data.topics import topics
    texts = [topics[k] for k in sorted(topics)]
    train = [f for f in corpus_files() if split_of(f) == "train"]
    ids, step = [], 1
    for text in texts:
        ids += tok.encode(text, bos=True) + [tok.eos_id]
    if len(ids) < tokens:  # every step-th training file, step chosen from the split's size (3.5 bytes a token)
        size = sum(len(t) for _, t in documents("train", max_files=50)) / 50
        step = max(1, int(len(train) * size / 3.5 / (tokens - len(ids))))
    for i, (_, text) in enumerate(documents("train")):
        if len(ids) >= tokens:
            break
        if i % step == 0:
            ids += tok.encode(text, bos=True) + [tok.eos_id]
    return np.array(ids[:tokens], dtype=np.int64)


@torch.no_grad()
def forced(model, tok, positions: int, window: int = 512, batch: int = 4) -> list[tuple[list[int], list[int]]]:
    """(tokens, labels) windows of `positions` tokens of the corpus in all: labels[t], the model's argmax after
    tokens[:t+1] (fast mode, one forward a batch of windows). Made once, then cached."""
    path = CACHE / f"forced-{fingerprint(model)}-{positions}-{window}.pt"
    if path.is_file():
        return torch.load(path)
    ids = corpus(tok, positions)
    windows = [ids[i:i + window].tolist() for i in range(0, len(ids), window)]
    data, t0 = [], time.time()
    for i in range(0, len(windows), batch):
        data += label(model, windows[i:i + batch])
        done, secs = sum(map(len, windows[:i + batch])), time.time() - t0
        print(f"forced: {done:,}/{len(ids):,} positions, {done / secs:,.0f} positions/s, "
              f"{fmt_time(secs / done * (len(ids) - done))} left", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(data, f))
    return data


@torch.no_grad()
def label(model, windows: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(window, labels) for each window: labels[t], the model's argmax after window[:t+1], one fast-mode forward."""
    T = max(map(len, windows))
    x = torch.tensor([w + [0] * (T - len(w)) for w in windows], device=model.embed.weight.device)
    labels = run(model, causal(x)).argmax(-1).tolist()  # right padding is harmless: causal
    return [(w, lab[:len(w)]) for w, lab in zip(windows, labels)]


def training_items(model, args, train: list, piece: int | None = None) -> list[tuple[list[int], list[int]]]:
    """A drafter trainer's (tokens, labels) items: its distilled pairs, then --forced teacher-forced positions (in
    windows of at most `piece` tokens)."""
    return [labelled(d) for d in train] + forced_items(model, args, piece)


def forced_items(model, args, piece: int | None = None) -> list[tuple[list[int], list[int]]]:
    """The --forced teacher-forced positions of a trainer's args as (tokens, labels) windows (none if 0)."""
    extra = forced(model, load_tokenizer(base_of(args.out)), args.forced) if args.forced else []
    return pieces(extra, piece) if piece else extra


def pieces(items: list, n: int) -> list[tuple[list[int], list[int]]]:
    """The items cut into pieces of at most n tokens (a trainer that packs a forward per sequence keeps them short);
    a piece with fewer than 2 labels is dropped."""
    out = [(t[i:i + n], lab[i:i + n]) for t, lab in items for i in range(0, len(t), n)]
    return [(t, lab) for t, lab in out if sum(v >= 0 for v in lab) >= 2]


def start(labels: list[int]) -> int:
    """One past the first labelled position: where drafting starts (a distilled pair's prompt length; none: the end)."""
    return next((i + 1 for i, v in enumerate(labels) if v >= 0), len(labels))


def labelled(pair: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """A distilled (prompt, greedy continuation) as (tokens, labels): the continuation is the model's own, so every
    label from the prompt's last token on is the next token (-100 elsewhere)."""
    p, c = pair
    seq = p + c
    return seq, [-100] * (len(p) - 1) + seq[len(p):] + [-100]


def targets(tokens: list[int], labels: list[int], K: int) -> torch.Tensor:
    """(T, K): the model's own token 1..K beyond the next at each position, where the text goes on as the model would
    up to there (each next token its argmax), else -100. Row t, column k-1 is labels[t + k] if tokens[t + j] ==
    labels[t + j - 1] for j = 1..k."""
    x, a = torch.tensor(tokens), torch.tensor(labels)
    T = len(x)
    agree = torch.zeros(T + K, dtype=torch.bool)
    agree[:T - 1] = (x[1:] == a[:-1]) & (a[:-1] >= 0)
    ahead = torch.cat([a, torch.full((K,), -100)])
    out, ok = torch.full((T, K), -100), torch.ones(T, dtype=torch.bool)
    for k in range(1, K + 1):
        ok &= agree[k - 1:T + k - 1]
        out[:, k - 1] = torch.where(ok, ahead[k:T + k], -100)
    return out


def main(argv=None):
    from ..io.checkpoint import load
    p = ArgumentParser(description="Make (and cache) teacher-forced self-distillation data for a base model.")
    p.add_argument("--weights", required=True)
    p.add_argument("--positions", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    check_device(args.device)
    base = base_of(args.weights)
    model = load(base, device=args.device)
    data = forced(model, load_tokenizer(base), args.positions, args.window)
    agree = sum(int((torch.tensor(t[1:]) == torch.tensor(lab[:-1])).sum()) for t, lab in data)
    print(f"{sum(len(t) for t, _ in data):,} positions in {len(data)} windows; the text goes on as the model would "
          f"at {agree / sum(len(t) - 1 for t, _ in data):.1%} of them")


if __name__ == "__main__":
    cli(main)
