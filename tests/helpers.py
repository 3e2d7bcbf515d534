"""Shared test helpers: random tiny models, an adversarial drafter, entry scripts run in-process."""
import contextlib
import importlib.util
import io
import random
from pathlib import Path

import torch
from hypothesis import strategies as st

from nanospec.cache import KVCache
from nanospec.engine import Drafter, generate, shapes
from nanospec.model import Block, Llama, ModelArgs
from nanospec.tree import Tree


def random_model(args: ModelArgs, seed=0, dtype=torch.float32, device="cpu") -> Llama:
    """A random Llama whose logits are spread out (std of a few units), so greedy near-ties are rare."""
    torch.manual_seed(seed)
    model = Llama(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
            else:
                p.uniform_(0.5, 1.5)  # norm weights
        if not args.tie_embeddings:
            model.lm_head.weight.mul_(3)
    return model.to(device=device, dtype=dtype).eval()


def full_logits(model, ids, exact):
    """Logits for every position of ids, as one chain block."""
    cache = KVCache.for_model(model, len(ids) + 1)
    return model(Tree.chain(ids[0], ids[1:]).block(0, model.embed.weight.device), cache, exact)[0]


def check_exact(model, prompt, drafter, n: int, sampling=None, fast: bool = True):
    """Decode with the drafter and with AR at shared shapes: the same tokens and bitwise the same
    logits in exact mode, and (fast=True) the same tokens in fast mode. Returns the exact output."""
    Q, S = shapes([drafter], len(prompt), n)
    kw = dict(max_new_tokens=n, Q=Q, n_slots=S, eos_id=-1, record_logits=True, **(sampling or {}))
    ar, out = generate(model, prompt, exact=True, **kw), generate(model, prompt, drafter, exact=True, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits)
    if fast:
        assert generate(model, prompt, drafter, **kw).tokens == generate(model, prompt, **kw).tokens
    return out


@st.composite
def model_args(draw) -> ModelArgs:
    """Tiny configs: MHA and GQA, odd sizes, optional rope scaling and tied embeddings."""
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    scaling = draw(st.sampled_from([None, {"rope_type": "linear", "factor": 2.0},
                                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}]))
    return ModelArgs(dim=draw(st.integers(4, 20)) * 2 + 1, n_layers=draw(st.integers(1, 3)),
                     n_heads=heads, n_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4, 6, 8, 10])),
                     vocab_size=draw(st.integers(5, 131)), hidden_dim=draw(st.integers(5, 61)),
                     rope_theta=draw(st.sampled_from([10000.0, 500.0])), rope_scaling=scaling,
                     tie_embeddings=draw(st.booleans()), norm_eps=1e-5)


class Adversary(Drafter):
    """Random trees that mix the true continuation with wrong branches, plus method-owned rows.

    truth: the tokens AR emits (the drafter peeks at them to make acceptances happen).
    extra_rows: rows appended after the tree (like BiTA mask rows or SDSAT adaptive rows)
    that see random tree rows and reserved slots; verified rows must not notice them.
    """
    name = "adversary"

    def __init__(self, truth, vocab_size, seed=0, max_nodes=12, extra_rows=0, reserved=0):
        self.truth, self.V, self.rng = truth, vocab_size, random.Random(seed)
        self.max_nodes, self.extra_rows, self.reserved_slots = max_nodes, extra_rows, reserved
        self.max_rows = max_nodes + extra_rows

    def start(self, dec):
        if self.reserved_slots:  # method-owned keys, e.g. BiTA's per-layer prompt keys
            self.slots = dec.reserved
            for k in (dec.cache.k, dec.cache.v):
                k[:, :, :, self.slots] = torch.randn_like(k[:, :, :, self.slots])

    def draft(self, dec):
        r, n = self.rng, len(dec.out)
        true = self.truth[n:n + 8]
        branches = []
        for _ in range(r.randint(0, 5)):
            keep = r.randint(0, len(true))
            branches.append(true[:keep] + [r.randrange(self.V) for _ in range(r.randint(0, 3))])
        tree = Tree.from_branches(dec.last, branches)
        while len(tree) > min(self.max_nodes, dec.room - self.extra_rows):
            branches.pop()
            tree = Tree.from_branches(dec.last, branches)
        return tree

    def forward(self, dec, tree):
        n, e = len(tree), self.extra_rows
        block = tree.block(dec.cur)
        if e and dec.room >= n + e:
            r, cur = self.rng, dec.cur
            seen = [[cur + r.randrange(n) for _ in range(3)] + [cur + n + i] for i in range(e)]
            if self.reserved_slots:
                seen = [self.slots.tolist() + s for s in seen]
            rows = Block(torch.randint(0, self.V, (1, e)), torch.full((1, e), cur + r.randrange(4)),
                         torch.arange(cur + n, cur + n + e), torch.full((1, e), cur), torch.tensor([seen]))
            block = Block.cat(block, rows)
        return dec.run(block)[:n]


def decode_main(argv):
    """decode.py's main(), imported from the repository root (it is a script, not a module)."""
    spec = importlib.util.spec_from_file_location("decode_script", Path(__file__).resolve().parents[1] / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def run_cli(main, *args) -> str:
    """Run an entry point as `nanospec.cli` does, expecting bad input: exit code 2 and exactly
    one stderr line, `error: ...`, which is returned."""
    from nanospec import cli
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            cli(lambda: main([str(a) for a in args]))
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
    return lines[0]
