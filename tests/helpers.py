"""Shared test helpers: random tiny models, an adversarial drafter, feeding a method AR's continuation (its own
warm_up, and a method-neutral peek), planted faults, in-process command lines, and the methods by name (the
registry's, with random trained parts) and the checks that the method, batch and device tests share. Nothing here
names a method: the registry does (nanospec.methods.METHODS)."""
import contextlib
import copy
import io
import itertools
import json
import random
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils._python_dispatch import TorchDispatchMode

from nanospec import cli, devices
from nanospec.cache import Block, KVCache
from nanospec.drafter import noisy  # noqa: F401 (the tests' random trained parts, as the methods' own)
from nanospec.engine import AR, Decoding, Drafter, generate, launch_step, lay_out, shapes
from nanospec.forward import context, run
from nanospec.methods import METHODS as REGISTRY
from nanospec.methods import split_specs
from nanospec.model import Llama, ModelArgs
from nanospec.tree import Groups, Tree
from nanospec.tuning.measured import Measured
from nanospec.verify import Sampler

ROOT = Path(__file__).resolve().parents[1]
PYLM = ROOT / "weights" / "pylm"  # the shipped default model and its drafters
# Tokens per step of shipped drafters (by spec) on the default model's first 4 held-out prompts, 64 new tokens each,
# exact fp32, static trees, measured when their weights were trained (python tests/test_default_model.py prints them)
FIGURES = json.loads((PYLM / "tokens_per_step.json").read_text())
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@lru_cache(maxsize=None)
def bpe(vocab_size: int = 400) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges) of a byte-level BPE trained on nanospec's own source."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([p.read_text() for p in sorted((ROOT / "nanospec").glob("*.py"))], trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


HF_FAMILIES = {  # name: (its transformers config class, the settings beside the shared ones)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),  # shorter than the prompts: the window matters
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 128}),  # its own head_dim (transformers' GGUF reader assumes 128)
    "qwen3-window": ("Qwen3Config", {"head_dim": 12, "use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": 0}),
}
PRE = {"llama": "llama-bpe", "mistral": "default", "qwen2": "qwen2", "qwen3": "qwen2"}  # each one's pre-tokenizer


def hf_family(path: Path, name: str, seed: int = 0, **settings):
    """A tiny random checkpoint of one of HF_FAMILIES as transformers writes it (save_pretrained), with a byte-level
    BPE tokenizer.json split as the family's tokenizers split (bpe()'s vocabulary) and a ChatML template. Its
    logits are spread out (std of a few units), so greedy near-ties are rare. settings: config values beside the
    family's (a window's length). Returns the transformers model."""
    transformers = pytest.importorskip("transformers")
    from nanospec.io.gguf_tokenizer import build
    transformers.logging.set_verbosity_error()
    tokens, merges = bpe()
    cls, extra = HF_FAMILIES[name]
    cfg = getattr(transformers, cls)(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=40, max_position_embeddings=256,
                                     bos_token_id=1, eos_token_id=2, **{**extra, **settings})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn_like(p) if n.endswith(".bias") else torch.rand_like(p) + 0.5)
    hf.save_pretrained(path)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": PRE[name.split("-")[0]],
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": CHAT}
    text, config = build(meta)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return hf


def family_args(args: ModelArgs, family: str, window: int = 6) -> ModelArgs:
    """args as one of FAMILIES: llama as it is, mistral with a sliding window, qwen2 with q/k/v biases, qwen3 with
    per-head q/k norms ("all": every switch at once, which no HF family has)."""
    return replace(args, qkv_bias=family in ("qwen2", "all"), qk_norm=family in ("qwen3", "all"),
                   sliding_window=window if family in ("mistral", "all") else None)


def random_model(args: ModelArgs, seed=0, dtype=torch.float32, device="cpu") -> Llama:
    """A random Llama whose logits are spread out (std of a few units), so greedy near-ties are rare."""
    torch.manual_seed(seed)
    model = Llama(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
            elif name.endswith(".bias"):
                p.normal_(0, 1)
            else:
                p.uniform_(0.5, 1.5)  # norm weights
        if not args.tie_embeddings:
            model.lm_head.weight.mul_(3)
    return model.to(device=device, dtype=dtype).eval()


class FixedCost(Measured):
    """The planner's costs as a line T(rows) = b0 + b1 * rows: plans that do not depend on the clock."""

    def __init__(self, b0: float, b1: float):
        super().__init__({1: b0 + b1, 2: b0 + 2 * b1})

    def update(self, *step, **how) -> None:
        pass  # no excess or price learnt from the steps' times


class Budgets:
    """A stand-in planner: each step's budget from a cycle (0: an AR step), over the drafter's own template."""

    def __init__(self, cycle):
        self.cycle, self.last = itertools.cycle(cycle), None

    def start(self, drafter, dec):
        pass

    def budget(self, decs):
        self.last = next(self.cycle)
        return self.last, None

    def observe(self, *args, **kwargs):
        pass

    def report(self):
        return ""


def from_branches(root: int, branches: list[list[int]]) -> Tree:
    """Token sequences that continue the root merged into one tree; shared prefixes share nodes."""
    tokens, parents, index = [root], [-1], {}
    for branch in branches:
        node = 0
        for tok in branch:
            if (node, tok) not in index:
                index[node, tok] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = index[node, tok]
    return Tree(tokens, parents)


def path_to(tree: Tree, i: int) -> list[int]:
    """Node i's path from the root, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = tree.parents[i]
    return path[::-1]


def descend(loss, params, lr: float, steps: int) -> tuple[float, float]:
    """loss() (a closure over fixed data) before and after `steps` AdamW steps on params."""
    opt = torch.optim.AdamW(params, lr=lr)
    before = loss().item()
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return before, loss().item()


def use_programs(monkeypatch, kind: str, programs) -> None:
    """Exact mode on devices of type kind runs its programs as `programs` (its defaults' entry replaced)."""
    monkeypatch.setitem(devices.DEVICES, kind, replace(devices.DEVICES[kind], programs=programs))


def full_logits(model, ids, exact, dev=None):
    """Logits for every position of ids, as one chain block (dev: the device's layout and speed, devices.py)."""
    cache = KVCache.for_model(model, len(ids) + 1, dev=dev)
    return run(model, Tree.chain(ids[0], ids[1:]).block(0, model.embed.weight.device), cache, exact, dev=dev)[0]


def rows_by_index(model, seed: int, T: int, device="cpu"):
    """Exact mode's premise, asserted: permuting a block's rows (each sees itself only, at a random position)
    permutes their logits and their RoPE tables (which a row that sees itself alone does not feel), bitwise: a
    row's results depend on its token and position alone."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.args.vocab_size, (1, T), generator=g)
    pos = torch.randint(0, 500, (1, T), generator=g)
    perm = torch.randperm(T, generator=g)
    slots = torch.arange(T)

    def rows(tok, p):
        blk = Block(tok, p, slots, torch.zeros_like(p), slots.view(1, T, 1)).to(device)
        ctx = context(model, blk, T, exact=True)
        return run(model, blk, None, exact=True)[0], ctx.cos[0], ctx.sin[0]
    for name, a, b in zip(("logits", "cos", "sin"), rows(tokens, pos), rows(tokens[:, perm], pos[:, perm])):
        assert torch.equal(a[perm], b), f"a row's {name} depend on its index"


def keys_in_order(ctx, b: int, t: int) -> list[int]:
    """The cache slots exact row t of sequence b reduces over, in order (exact.attend): those it reads in place, in
    slot order, then its gathered tail; key head 0's (every key head's alike)."""
    c = ctx.canonical
    (B, _, T, W), Hkv = c.tail_slots.shape, c.key_heads.numel()
    in_place = c.in_place.reshape(B, Hkv, T, -1, c.in_place.shape[-1])[b, 0, t, 0] == 0
    gathered = c.gathered.reshape(B, Hkv, T, W)[b, 0, t] == 0
    return in_place.nonzero().flatten().tolist() + c.tail_slots[b, 0, t][gathered].tolist()


def one_forward(model, drafter, tree, prompt, exact, plain=False):
    """The drafter's verification forward over one tree after prompt, unverified: (logits of the
    tree's nodes, drafts per node). plain=True: the tree's rows alone, through AR's forward."""
    cache = KVCache.for_model(model, 128)
    dec = Decoding(model, cache, exact, 112, prompt, cache.reserve(drafter.reserved_slots),
                   sampler=Sampler(temperature=1.0))  # the sampled program: the logits and drafts, unverified
    dec.prefill(prompt[:-1])
    drafter.start(dec)
    d = Drafter() if plain else drafter
    block, nodes, cache_rows = lay_out([dec], d, [tree])
    (logits, drafts, _, _), _ = launch_step([dec], d, block, nodes, cache_rows)
    return logits[0, :len(tree)], None if drafts is None else drafts[0, :len(tree)]


def check_exact(model, prompt, drafter, n: int, sampling=None, fast: bool = True, peeking: float = 0.0,
                seed: int = 0, tight: bool = False, on_step=None):
    """Decode with the drafter and with AR at shared shapes: the same tokens and bitwise the same
    logits in exact mode, and (fast=True) the same tokens in fast mode, the drafting hooks leaving the
    decoding state as they found it (guarded). Returns the exact output.

    peeking > 0: the drafter is fed AR's continuation (feed: its own warm_up, and a peek with probability
    peeking), so its forward runs on accepted drafts. tight: a cache just large enough for the prompt and
    the n new tokens, so the last steps run with almost no room (the engine must trim the trees). on_step:
    the exact run's engine.generate on_step."""
    Q, S, W = shapes([drafter], len(prompt), n)
    if tight:
        S = len(prompt) + n + drafter.reserved_slots + 1
    kw = dict(max_new_tokens=n, Q=Q, n_slots=S, tail=W, eos_id=-1, record_logits=True, **(sampling or {}))
    ar = generate(model, prompt, exact=True, **kw)
    if peeking:
        feed(drafter, [prompt], [ar], peeking, seed)
    guarded(drafter)
    out = generate(model, prompt, drafter, exact=True, on_step=on_step, **kw)
    assert out.tokens == ar.tokens and torch.equal(out.logits, ar.logits), f"{drafter.name}: not AR's tokens and bits"
    assert len(out.tokens) == n
    if fast:
        assert generate(model, prompt, drafter, **kw).tokens == generate(model, prompt, **kw).tokens
    return out


def decoding_state(dec) -> tuple:
    """What a Decoding holds that the engine alone may change: its text, cursor, cache row and next candidates."""
    return (list(dec.prompt), list(dec.out), dec.root, dec.cur, dec.cache_row, dec.room,
            None if dec.cands is None else dec.cands.tolist(), copy.deepcopy(dec.lists))


def guarded(drafter):
    """The drafter with its drafting hooks (draft, match_length) checked to leave the decoding state as they found
    it: the contract's (drafter.py) "none writes the Decoding"; its AssertionError names the hook."""
    for hook in ("draft", "match_length"):
        real = getattr(drafter, hook)

        def checked(dec, *a, real=real, hook=hook):
            before = decoding_state(dec)
            out = real(dec, *a)
            assert decoding_state(dec) == before, f"{drafter.name}'s {hook} hook changed the decoding state"
            return out
        setattr(drafter, hook, checked)
    return drafter


def peek(drafter, truths, p: float = 0.9, seed: int = 0):
    """A truth-peeking variant of a drafter, method-neutral: before it drafts, the candidates its last
    accepted node proposed (cands[d]: ranked tokens for output position len(out) + d) get the
    true token (truths: AR's output, or per prompt in a batch: {tuple(prompt): output}) at rank 0
    of the first depth, and of each deeper depth with probability p (there
    mostly rank 0, sometimes another rank). The rest stays the method's own, so its own forward
    (heads, mask rows, pseudo states, adaptive tokens, pruning, layer loops) runs on trees that do
    get accepted, in part. A drafter without candidates (a context drafter) drafts as it would:
    feed gives it the truth through its own warm_up.

    Peeking tests are exactness tests: they show the bitwise checks run on accepted drafts (not
    vacuously on rejected ones). How good a method's own drafts are, fed this way, is its floor's
    test (test_edges.py)."""
    rng = random.Random(seed)
    draft = drafter.draft

    def drafting(dec, cands, template, budget):
        n, truth = len(dec.out), truths[tuple(dec.prompt)] if isinstance(truths, dict) else truths
        if cands is not None:
            cands = cands.clone()
            for d in range(len(cands)):
                if n + d < len(truth) and (d == 0 or rng.random() < p):
                    cands[d, 0 if d == 0 or rng.random() < 0.8 else rng.randrange(cands.shape[1])] = truth[n + d]
        return draft(dec, cands, template, budget)
    drafter.draft = drafting
    return drafter


def feed(drafter, prompts, alone, p: float = 0.9, seed: int = 0):
    """Drafts that carry AR's own tokens (alone: each prompt's AR Output), so they get accepted, the same way for
    every method: each prompt's last token and its AR output as text to draft from (Drafter.warm_up: a context
    drafter's, placed earlier in its context), and a peek with probability p at the candidates of a drafter
    that has them."""
    drafter.warm_up([list(q[-1:]) + a.tokens for q, a in zip(prompts, alone)])
    return peek(drafter, {tuple(q): a.tokens for q, a in zip(prompts, alone)}, p, seed)


class Corrupt(Drafter):
    """AR with a planted fault: at step `at` the verification forward's root row is wrong. ulp=False:
    the runner-up token wins (a changed output token); ulp=True: the smallest logit moves by one
    ulp (the same tokens, different bits). Detectors must catch both. (Eager only: a CUDA graph
    would replay the first step's choice.)"""
    name = "corrupt"

    def __init__(self, at: int = 3, ulp: bool = False):
        self.at, self.ulp = at, ulp

    @classmethod
    def load(cls, model, weights, at=3, ulp=False):  # --method corrupt:at=N,ulp=true, registered by a test
        return cls(at, ulp)

    def start(self, dec):
        self.step = 0

    def draft(self, dec, *a):
        self.step += 1
        return super().draft(dec, *a)

    def forward(self, f, nodes):
        out = super().forward(f, nodes)
        if self.step == self.at:
            row = out.logits[0, 0]  # the root row of the (only) sequence
            if self.ulp:
                j = row.argmin()
                row[j] = torch.nextafter(row[j], row[j] + 1)
            else:
                row[row.argsort()[-2]] = row.max() + 1
        return out


def call(main, *argv) -> tuple[int, str, str]:
    """An entry script's main(argv) run in-process as its command line runs it (through nanospec.cli):
    (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli(lambda: main([str(a) for a in argv]))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@st.composite
def model_args(draw) -> ModelArgs:
    """Tiny configs of every family (a window from 1 slot up): MHA and GQA, odd sizes, optional rope scaling and
    tied embeddings."""
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    scaling = draw(st.sampled_from([None, {"rope_type": "linear", "factor": 2.0},
                                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}]))
    family, window = draw(st.sampled_from(FAMILIES)), draw(st.integers(1, 24))
    return family_args(ModelArgs(dim=draw(st.integers(4, 20)) * 2 + 1, n_layers=draw(st.integers(1, 3)),
                     n_heads=heads, n_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4, 6, 8, 10])),
                     vocab_size=draw(st.integers(5, 131)), intermediate_size=draw(st.integers(5, 61)),
                     rope_theta=draw(st.sampled_from([10000.0, 500.0])), rope_scaling=scaling,
                     tie_embeddings=draw(st.booleans()), norm_eps=1e-5), family, window)


class Adversary(Drafter):
    """Random trees that mix the true continuation with wrong branches, plus method-owned rows.

    truth: the tokens AR emits (the drafter peeks at them to make acceptances happen).
    extra_rows: rows appended after the tree (like BiTA mask rows or SDSAT adaptive rows), random tokens in a group
    after a random node, chained or not, that see the reserved slots; verified rows must not notice them.
    """
    name = "adversary"

    def __init__(self, truth, vocab_size, seed=0, max_nodes=12, extra_rows=0, reserved=0):
        self.truth, self.V, self.rng = truth, vocab_size, random.Random(seed)
        self.max_nodes, self.extra_rows, self.reserved_slots = max_nodes, extra_rows, reserved
        self.max_rows = max_nodes + extra_rows

    def start(self, dec):
        if self.reserved_slots:  # method-owned keys, e.g. BiTA's per-layer prompt keys
            self.slots = torch.tensor(dec.reserved)
            kv = dec.cache.kv
            kv[..., self.slots, :] = torch.randn_like(kv[..., self.slots, :])

    def draft(self, dec, cands, template, budget):
        r, n = self.rng, len(dec.out)
        true = self.truth[n:n + 8]
        branches = []
        for _ in range(r.randint(0, 5)):
            keep = r.randint(0, len(true))
            branches.append(true[:keep] + [r.randrange(self.V) for _ in range(r.randint(0, 3))])
        tree = from_branches(dec.root, branches)
        return tree.prefix(min(len(tree), self.max_nodes))  # the engine trims it to the cache's room

    def rows(self, n, budget=None):
        return n + self.extra_rows

    def groups(self, tree, n, budget=None):
        e, r = self.extra_rows, self.rng
        if not e:
            return Groups()
        return Groups((r.randrange(len(tree)),), e, sees_reserved=bool(self.reserved_slots), chained=r.random() < 0.5,
                      tokens=tuple(r.randrange(self.V) for _ in range(e)))


def run_cli(main, *argv) -> str:
    """An entry point given bad input: exit code 2 and exactly one stderr line, `error: ...`,
    which is returned."""
    code, _, err = call(main, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def decode_main(argv):
    import decode  # the script at the repository root (python -m pytest puts it on the path)
    return decode.main(argv)


PRODUCT_FORMS = {  # a product's forms over n items of 16 rows: x (n, 16, K), w (N, K), b (n, 16, N) -> (n, 16, N)
    "linear": lambda x, w, b: torch.nn.functional.linear(x, w),
    "matmul": lambda x, w, b: x @ w.T,
    "addmm": lambda x, w, b: torch.addmm(b.flatten(0, 1), x.flatten(0, 1), w.T).view(b.shape),
    "bmm": lambda x, w, b: torch.bmm(x, w.T.expand(len(x), -1, -1)),
    "baddbmm": lambda x, w, b: torch.baddbmm(b, x, w.T.expand(len(x), -1, -1), alpha=0.5),
}


class ProductsOf(TorchDispatchMode):
    """Records every matrix product that reads a given weight (through any view of it), however the
    product is called (a layer's forward, F.linear, a tuned kernel)."""
    aten = torch.ops.aten
    PRODUCTS = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
                aten.baddbmm.default}

    def __init__(self, weight):
        super().__init__()
        self.storage, self.calls = weight.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage
                                         for a in args):
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


class RowCountProducts(TorchDispatchMode):
    """The matrix products (F.linear, @, bmm, mm, and addmm/baddbmm's epilogue) as a library that picks its
    kernel by a product's total rows computes them, as cuBLAS does in fp32: the inner dimension summed in
    max(1, 256 // rows) parts (split-K, more parts for fewer rows), each part rounded to the output's
    dtype. A row's bits depend on its own inputs and on the product's total rows, never on the other
    rows' values: what exact mode's block batch must make constant."""
    aten = torch.ops.aten
    PRODUCTS = {aten.linear.default, aten.matmul.default, aten.bmm.default, aten.mm.default}
    EPILOGUES = {aten.addmm.default, aten.baddbmm.default}  # input + alpha * (a @ b)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.EPILOGUES and set(kwargs) <= {"alpha"} and args[1].dim() >= 2:
            return args[0] + kwargs.get("alpha", 1) * self.split_k(args[1], args[2])
        if func not in self.PRODUCTS or kwargs or args[0].dim() < 2 or args[1].dim() < 2:
            return func(*args, **kwargs)
        x, y = args[0], args[1]
        if func is self.aten.linear.default:
            y = y.transpose(-1, -2)
        out = self.split_k(x, y)
        return out if len(args) < 3 or args[2] is None else out + args[2]

    @staticmethod
    def split_k(x, y):
        K = x.shape[-1]
        parts = max(1, min(K, 256 // (x.numel() // max(K, 1))))
        edges = [K * i // parts for i in range(parts + 1)]
        return sum(torch.matmul(x[..., a:b], y[..., a:b, :]) for a, b in zip(edges, edges[1:]))


class AlignedProducts(TorchDispatchMode):
    """The matrix products (mm, bmm, and addmm/baddbmm's epilogue) as a CPU BLAS that takes an alignment-dependent
    path computes them: a row of the left matrix that starts 64-byte aligned runs the host's product; one that does
    not first sums its elements up to the next 64-byte boundary (a peeled head loop), then the rest, and adds the
    two in the output's dtype. A row's bits depend on its own inputs and on where it starts in memory, never on the
    other rows' values: what exact mode's aligned rows (devices.CPU.rows) must make constant."""
    aten = torch.ops.aten
    PRODUCTS = {aten.mm.default, aten.bmm.default}
    EPILOGUES = {aten.addmm.default, aten.baddbmm.default}  # input + alpha * (a @ b)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.EPILOGUES and set(kwargs) <= {"alpha"}:
            x, y, put = args[1], args[2], lambda p: args[0] + kwargs.get("alpha", 1) * p
        elif func in self.PRODUCTS and not kwargs:
            x, y, put = args[0], args[1], lambda p: p
        else:
            return out
        head = (64 - self.starts(x)) % 64 // x.element_size()  # a misaligned row's elements before the boundary
        if not head.any():
            return out
        first = torch.arange(x.shape[-1]) < head[..., None]
        peeled = put(x.masked_fill(~first, 0) @ y + x.masked_fill(first, 0) @ y)
        return torch.where((head > 0)[..., None], peeled, out)

    @staticmethod
    def starts(x) -> torch.Tensor:
        """Each row's start address modulo 64 bytes, x.shape[:-1]."""
        at = torch.zeros(x.shape[:-1], dtype=torch.long)
        for d, (n, s) in enumerate(zip(x.shape[:-1], x.stride()[:-1])):
            at = at + torch.arange(n).view(-1, *[1] * (x.dim() - 2 - d)) * s
        return (x.data_ptr() + at * x.element_size()) % 64


class ScalarRemainders(TorchDispatchMode):
    """The elementwise kernels exact mode runs row-wise (silu, cos, sin: devices.CPU.elementwise) as a CPU runs them: a
    call's elements, in row-major order, split into threads' contiguous runs as PyTorch's parallel_for splits them
    (grain 32768, here always 4 threads), each run computed in SIMD chunks of two 64-byte vectors, and the elements
    past a run's last whole chunk on a scalar path whose result lands one ulp above the SIMD path's. An element's
    bits depend on its value and on its place in its call: what rowwise's padded rows and one-thread calls make
    constant."""
    aten = torch.ops.aten
    FUNCS = {aten.silu.default, aten.cos.default, aten.sin.default}
    GRAIN, THREADS = 32768, 4

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.FUNCS:
            return out
        scalar = self.scalar(out.numel(), out.element_size()).view(out.shape)
        return torch.where(scalar, torch.nextafter(out, out.new_tensor(torch.inf)), out)

    @classmethod
    def scalar(cls, n: int, element_size: int) -> torch.Tensor:
        """(n,) bool: the elements of an n-element call that take the scalar path."""
        tasks = max(1, min(cls.THREADS, -(-n // cls.GRAIN)))
        run, chunk = -(-n // tasks), 128 // element_size
        i = torch.arange(n)
        start = i // run * run
        end = (start + run).clamp(max=n)
        return i >= end - (end - start) % chunk


# --- text for tokenizers -----------------------------------------------------------------------

def mixed_lines(n_unicode: int = 600) -> list[str]:
    """Code (nanospec and tests), prose (the README), unicode from many scripts, special tokens."""
    files = sorted((ROOT / "nanospec").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")) + [ROOT / "README.md"]
    lines = [line for f in files for line in f.read_text().splitlines()]
    rng = random.Random(0)
    alphabet = "aé日本語кириллицаعربي😀🤗\u2581\u00a0\t  \n0123456789½²٣" + "".join(SPECIALS)
    lines += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n_unicode)]
    lines += [f"{a}user\n{b}{c}" for a, b, c in zip(SPECIALS, ["hi", "x = 1", "  12345"], SPECIALS[::-1])]
    return lines


# --- the methods, by name ----------------------------------------------------------------------

METHODS = list(REGISTRY)  # every registered method, AR first: each generic test runs each (pytest -k NAME)
DRAFTING = [n for n in METHODS if n != "ar"]  # the methods that draft (AR, the baseline, does not)
# the specs run on the default model: those with a figure, and every other method decoding it, by its name alone
SHIPPED = list(FIGURES) + [n for n in split_specs("all") if n != "ar" and all(s.split(":")[0] != n for s in FIGURES)]
ARGS = ModelArgs(dim=30, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=6, vocab_size=53, intermediate_size=37)
EOS = 5  # check_batch's end of sequence


def drafter(name, model, seed: int = 0):
    """The registered method of that name with random trained parts (Drafter.random), on the model's device and
    dtype (AR: a Drafter of its own, which a test may change)."""
    return REGISTRY[name].random(model, seed)


def each_method(examples: int):
    """Hypothesis settings for a property that runs once per method (parametrized by METHODS): the profile's
    share of `examples` (of the default profile's 25), split among the methods, at least 2 each, so that running
    every method costs what one drawing among them did."""
    share = examples * settings.default.max_examples / 25
    return settings(max_examples=max(2, int(share // len(METHODS))), deadline=None)


def each_dtype():
    """Hypothesis settings for a method's exactness property run once per dtype (parametrized by DTYPES): the
    profile's examples split between fp32 and bf16, so that both cost what one property does."""
    return settings(max_examples=max(2, settings.default.max_examples // 2), deadline=None)

def check_batch(model, prompts, d, n, exact=True, peeking: float = 0.0, seed=0, sampling=None, rows=None,
                block_batch=None):
    """The batch against each prompt decoded alone by AR at the same shapes (Q, S): the same tokens
    and stop, and in exact mode bitwise the same logits (fast mode: fp32 only; in bf16 a near-tie
    may flip with a block's shape); the drafting hooks leave each decoding's state as they found it.
    peeking: how often the drafts carry AR's tokens (feed; 0: not fed). rows: the sequences decoded at
    once (None: all). block_batch: every exact forward runs that many sequences' blocks, alone and in
    the batch."""
    d = d or AR
    Q, S, W = shapes([d], max(map(len, prompts)), n)
    kw = dict(max_new_tokens=n, exact=exact, Q=Q, n_slots=S, tail=W, eos_id=EOS, record_logits=True,
              block_batch=block_batch, **(sampling or {}))
    alone = [generate(model, p, **kw) for p in prompts]
    if d is not AR:
        if peeking:
            feed(d, prompts, alone, peeking, seed)
        guarded(d)
    batch = generate(model, prompts, d, batch=rows, **kw)
    assert len(batch) == len(prompts)
    for i, (a, b) in enumerate(zip(alone, batch)):
        assert b.tokens == a.tokens and b.stop == a.stop, f"sequence {i}"
        if exact:
            assert torch.equal(b.logits, a.logits), f"sequence {i}: logits differ"
    return batch


def reaches_floor(name, device="cpu", seed: int = 0, checked: bool = True) -> float:
    """The method's tokens per step (returned), fed AR's continuation (feed) in a cache with room for the prompt
    and 96 new tokens only, of Drafter.random(model, seed): at least its declared floor (Drafter.floor), which a
    method that drafts worse falls under. checked: in exact mode, checked against AR (check_exact); else the same
    decoding in fast mode alone (the same tokens, so the same drafts: a planted fault's cheaper run)."""
    floor = REGISTRY[name].floor
    model, prompt, n = random_model(ARGS, seed=11, device=device), [3, 9, 4, 1, 7, 12, 5], 96
    d = drafter(name, model, seed)
    if checked:
        out = check_exact(model, prompt, d, n, peeking=0.9, seed=5, tight=True)
    else:
        S = len(prompt) + n + d.reserved_slots + 1
        feed(d, [prompt], [generate(model, prompt, max_new_tokens=n, eos_id=-1)], 0.9, 5)
        out = generate(model, prompt, d, max_new_tokens=n, n_slots=S, eos_id=-1)
    assert out.stop == "max_new_tokens"
    assert floor is not None, f"{name} declares no floor: set its Drafter.floor (it reached {out.tokens_per_step:.2f})"
    assert out.tokens_per_step >= floor, \
        f"{name} reached {out.tokens_per_step:.2f} tokens per step fed AR's continuation, under its floor {floor}"
    return out.tokens_per_step
