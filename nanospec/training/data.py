"""The default model's corpus: the .py files of the running interpreter's standard library.

Offline everywhere. The split is per file, by a stable hash of the path relative to
the stdlib root: sha256(path) as an integer, mod 100, below 5 is held out ("val"),
the rest is "train". The same Python version gives the same split on every machine;
another version has other files and so a somewhat different corpus.

Held-out files also give the evaluation prompts: a function's signature and
docstring, cut at the line boundary after the docstring, so the model writes the body.

    python -m nanospec.training.data --prompts weights/pylm/prompts.jsonl   # regenerate the prompt set
    python -m nanospec.training.data --responses .cache/warmup.jsonl -n 1000  # training-split functions
"""
import ast
import hashlib
import json
import sys
import sysconfig
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import ArgumentParser, NanospecError, cli
from ..engine import generate
from ..io.files import atomic_write

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VAL_PERCENT = 5
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "data"


def split_of(rel: str) -> str:
    """'val' or 'train' for a path relative to the stdlib root (posix form)."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return "val" if h % 100 < VAL_PERCENT else "train"


def corpus_files(root: Path = STDLIB) -> list[str]:
    """Relative paths of the stdlib's .py files (site-packages excluded), sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if "site-packages" not in p.relative_to(root).parts)


def documents(split: str, root: Path = STDLIB, max_files: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the split's files; files that are not UTF-8 (test data) are skipped."""
    docs = []
    for rel in corpus_files(root):
        if split_of(rel) != split:
            continue
        try:
            docs.append((rel, (root / rel).read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
        if max_files and len(docs) == max_files:
            break
    return docs


def token_stream(tok, split: str, max_files: int | None = None) -> np.ndarray:
    """The split as one uint16 array: BOS, file tokens, EOS, for each file. Cached outside git."""
    key = tok.identity
    name = f"{sys.version_info[0]}.{sys.version_info[1]}-{key}-{split}{f'-{max_files}' if max_files else ''}.npy"
    path = CACHE / name
    if path.is_file():
        return np.load(path)
    ids = []
    for _, text in documents(split, max_files=max_files):
        ids += tok.encode(text, bos=True) + [tok.eos_id]
    arr = np.array(ids, dtype=np.uint16)
    CACHE.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: np.save(open(p, "wb"), arr))
    return arr


def split_bytes(split: str, max_files: int | None = None) -> int:
    """UTF-8 bytes of the split's text (for bits per byte)."""
    return sum(len(text.encode()) for _, text in documents(split, max_files=max_files))


def functions(text: str, max_chars: int = 600) -> list[tuple[str, str]]:
    """(signature + docstring, body) of each function with a body of 3+ lines after its docstring."""
    try:
        with warnings.catch_warnings():  # a corpus file's own invalid escapes are not ours to report
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines, out = text.splitlines(keepends=True), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        if len(node.body) < 2 or node.end_lineno - doc.end_lineno < 3:
            continue
        src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).splitlines(keepends=True)
        cut = doc.end_lineno - node.lineno + 1
        prompt = "".join(src[:cut])
        if len(prompt) <= max_chars and prompt.startswith(("def ", "async def ")):
            out.append((prompt, "".join(src[cut:])))
    return out


def function_prompts(text: str, max_chars: int = 600) -> list[str]:
    return [p for p, _ in functions(text, max_chars)]


def eval_prompts(n: int = 64, per_file: int = 2) -> list[str]:
    """n held-out prompts, at most per_file from each file, spread evenly over the candidates."""
    cands = [p for _, text in documents("val") for p in function_prompts(text)[:per_file]]
    if len(cands) <= n:
        return cands
    return [cands[i * len(cands) // n] for i in range(n)]


def instruction(prompt: str) -> str:
    """A chat request made of a function prompt (its signature and docstring): implement it."""
    return f"Implement this Python function:\n\n```python\n{prompt}```"


def chat_encoder(weights):
    """text -> prompt ids through the weights' chat template, or None when they have none."""
    from ..io.chat import prompt_ids
    from ..io.tokenizer import load_tokenizer
    tok = load_tokenizer(weights)
    try:
        prompt_ids(weights, tok, "")
    except NanospecError:
        return None
    return lambda text: prompt_ids(weights, tok, text)[0]


def train_functions(n: int) -> list[tuple[str, str]]:
    """n (prompt, body) pairs from training files, spread evenly (e.g. Lookahead's warm-up responses)."""
    cands = [f for _, text in documents("train") for f in functions(text)]
    return cands if len(cands) <= n else [cands[i * len(cands) // n] for i in range(n)]


def distill_args(p):
    """Self-distillation data options, shared by the trainers that use `distill`."""
    p.add_argument("--distill-prompts", type=int, default=2000, help="training-split prompts to continue")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--train-seqs", type=int,
                   help="train on N of the training sequences, spread evenly (held-out unchanged)")
    p.add_argument("--save-every", type=int, help="steps between resumable checkpoints in --cache (--resume)")
    p.add_argument("--forced", type=int, default=0, help="also train on this many teacher-forced positions")


def distill_prompts(tok, n: int, chat=None) -> list[list[int]]:
    """The n prompts `distill` continues, in its order: by length (every 10th is held out of training)."""
    fns = train_functions(n)
    return sorted([chat(instruction(p)) if chat and i % 2 else tok.encode(p) for i, (p, _) in enumerate(fns)], key=len)


def distill(model, tok, n: int = 2000, new_tokens: int = 128, batch: int = 64,
            chat=None) -> list[tuple[list[int], list[int]]]:
    """Self-distillation data: (prompt, the model's greedy continuation) for n training-split
    function prompts; with a chat encoder (chat_encoder), every other one is a chat request to
    implement the function instead, and its reply is cut after the end of the turn. Generated
    batched once, then cached under .cache/ by the model's fingerprint."""
    from ..io.files import fingerprint
    path = CACHE / f"distill-{fingerprint(model)}-{n}-{new_tokens}{'-chat' if chat else ''}.pt"
    if path.is_file():
        return torch.load(path)
    prompts = distill_prompts(tok, n, chat)  # similar lengths batch well
    data, t0 = [], time.time()
    for i in range(0, len(prompts), batch):
        part = prompts[i:i + batch]
        data += [(p, o.tokens) for p, o in zip(part, generate(model, part, max_new_tokens=new_tokens, eos_id=-1))]
        done = len(data)
        eta = (time.time() - t0) / done * (len(prompts) - done)
        print(f"distill: {done}/{len(prompts)} prompts, {done * new_tokens / (time.time() - t0):.0f} tok/s, "
              f"eta {eta:.0f}s", flush=True)
    if chat:  # a reply ends with its turn
        eos = model.args.eos_id
        data = [(p, c[:c.index(eos) + 1] if eos in c else c) for p, c in data]
    CACHE.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(data, f))
    return data


def main(argv=None):
    p = ArgumentParser(description="Corpus statistics; write the held-out prompt set.")
    p.add_argument("--prompts", help="write the evaluation prompts here (JSONL)")
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--responses", help="write -n training-split functions as {\"prompt\", \"response\"} JSONL")
    p.add_argument("--chat", metavar="WEIGHTS", help="--prompts: half of them as chat requests, rendered with "
                   "these weights' chat template")
    args = p.parse_args(argv)
    files = corpus_files()
    val = sum(split_of(f) == "val" for f in files)
    print(f"stdlib {STDLIB} (Python {sys.version.split()[0]}): {len(files)} files, {val} held out")
    if args.prompts:
        prompts = eval_prompts(args.n)
        if args.chat:  # the first half as code, the second as chat requests (rendered: any engine can take them)
            from ..io.chat import render, template
            from ..io.sources import base_of
            from ..io.tokenizer import load_tokenizer
            base = base_of(args.chat)
            tmpl, config = template(base), load_tokenizer(base).config
            half = len(prompts) // 2
            prompts = prompts[:half] + [render(instruction(p), tmpl, config) for p in prompts[half:2 * half]]
        body = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
        atomic_write(Path(args.prompts), lambda f: f.write_text(body))
        print(f"wrote {len(prompts)} prompts to {args.prompts}")
    if args.responses:
        pairs = train_functions(args.n)
        body = "".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs)
        Path(args.responses).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(args.responses), lambda f: f.write_text(body))
        print(f"wrote {len(pairs)} training-split functions to {args.responses}")


if __name__ == "__main__":
    cli(main)
