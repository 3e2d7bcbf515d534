"""ProPD: early pruning, the dynamic tree (the core planner with the paper's online costs), the
drafter's exactness and the early-head trainer. (The planner's own tests: test_planner.py.)"""
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import FixedCost, check_exact, each_dtype, model_args, path_to, random_model
from nanospec import NanospecError, planner
from nanospec.engine import generate
from nanospec.io.checkpoint import load
from nanospec.methods.medusa import Heads
from nanospec.methods.propd import EarlyHead, ProPD, pruned, samples, train_early
from nanospec.model import ModelArgs
from nanospec.training.forced import labelled
from nanospec.tree import Layout, Nodes, Tree
from nanospec.tree import choose_tree as medusa_tree
from nanospec.tuning.probing import BUDGETS, own_budgets
from nanospec.tuning.products import BUCKETS

# --- early pruning and the drafter ---------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACC = [[0.5, 0.3, 0.2]] * 3


def nodes_of(tree):
    """A batch of one tree, as the engine hands a method's forward."""
    lay = Layout.of(tree.parents)
    lay = type(lay)(*(t[None] for t in (lay.parent, lay.depth, lay.index, lay.anc)))
    return Nodes(torch.tensor(tree.tokens)[None], lay, torch.ones(1, len(tree), dtype=torch.bool), len(tree))


def pruned_rows(propd) -> int:
    """Rows ProPD's early head removed so far."""
    return int(propd.pruning[1])


class KeepTruth(torch.nn.Module):
    """ProPD's early head, aimed at each step's tree: random logits per row (so pruning removes
    random branches), except that a node on the true path ranks its true child first. One table,
    updated in place, so a CUDA graph captured with it reads each step's values."""

    def __init__(self, V: int, like: torch.Tensor, seed: int, rows: int = 256):
        super().__init__()
        self.rng = random.Random(seed)
        self.table = torch.zeros(rows, V, dtype=like.dtype, device=like.device)

    def aim(self, tree: Tree, truth: list[int]):
        g = torch.Generator().manual_seed(self.rng.randrange(2**31))
        table = torch.randn(self.table.shape, generator=g)
        tokens = tree.token_list()
        for node in range(len(tree)):
            path = path_to(tree, node)
            d = len(path) - 1
            if d < len(truth) and [tokens[i] for i in path[1:]] == truth[:d]:
                table[node, truth[d]] = 1e4
        self.table.copy_(table)

    def forward(self, x):  # x (B, N, D): one aimed tree, so a batch of one
        return self.table[:x.shape[-2]].expand(*x.shape[:-1], -1)


def aimed(d: ProPD, truth: list[int], seed: int) -> ProPD:
    """d with an early head that prunes at random but keeps the true path (truth: AR's output)."""
    d.early, draft = KeepTruth(d.early.up.out_features, d.early.up.weight, seed), d.draft

    def drafting(dec, *a):
        tree = draft(dec, *a)
        d.early.aim(tree, truth[len(dec.out):])
        return tree
    d.draft = drafting
    return d


def test_pruning_takes_descendants_and_keeps_the_root():
    #        0:root
    #     1:a      2:b
    #   3:c  4:d    5:e
    tree = Tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2])
    x = torch.zeros(6, 10)
    x[0, [1, 7]] = 1.0  # root's top-2: tokens 1 and 7 -> node 2 (b) and its child 5 go
    x[1, [3, 8]] = 1.0  # a's top-2: 3 and 8 -> node 4 (d) goes
    early = lambda h: h  # the states are the early logits
    assert pruned(nodes_of(tree), x[None], early, k=2)[0].nonzero()[:, 0].tolist() == [2, 4, 5]
    assert not pruned(nodes_of(tree), x[None], early, k=10).any()
    assert not pruned(nodes_of(Tree.chain(9)), x[None, :1], early, k=1).any()


@pytest.mark.parametrize("dtype", DTYPES)
@each_dtype()
@given(args=model_args(), seed=st.integers(0, 2**16), plen=st.integers(1, 30), size=st.integers(1, 20),
       k=st.integers(1, 4), sampled=st.booleans(), prune=st.booleans(), dynamic=st.booleans(),
       row_cost=st.sampled_from([1e-5, 1e-3]))
def test_propd_equals_ar(device, dtype, args, seed, plen, size, k, sampled, prune, dynamic, row_cost):
    """Pruning and dynamic trees change nothing: bitwise logits in exact mode, tokens in fast mode.
    The heads' candidates carry the true continuation (helpers.peek) and the early head prunes
    random branches but not the true one (aimed), so the pruned forward runs on accepted drafts. The
    planner's cost model is fixed (cheap or dear rows), so its plans do not depend on timings."""
    model = random_model(args, seed, DTYPES[dtype], device)
    torch.manual_seed(seed)
    heads = Heads(args.dim, args.vocab_size, 3).init_from(model.lm_head).to(device=device, dtype=DTYPES[dtype])
    early = EarlyHead(args.dim, args.vocab_size, 3, args.norm_eps).to(device=device, dtype=DTYPES[dtype])
    layer = seed % args.n_layers + 1 if args.n_layers > 1 else 1
    d = ProPD(heads, medusa_tree(ACC, size), ACC, early if prune else None, layer, k, dynamic,
              budgets=(1, 3, size), replan=4, cost=FixedCost(1e-2, row_cost))
    prompt = torch.randint(0, args.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else {}
    if prune:
        aimed(d, generate(model, prompt, max_new_tokens=24, exact=True, eos_id=-1, **sampling).tokens, seed)
    out = check_exact(model, prompt, d, 24, sampling, fast=dtype == "fp32", peeking=0.9, seed=seed)
    assert out.tokens_per_step >= 1.5
    if prune and not dynamic and size >= 3 and 2 * k <= args.vocab_size:  # wrong branches to prune
        assert pruned_rows(d) > 0


class FakeDec:
    def __init__(self):
        self.out, self.cur = [], 0


def test_acceptance_resolves_each_prediction_when_its_token_arrives():
    d = ProPD(Heads(4, 10, 2), [(0,)], [[0.5, 0.5], [0.5, 0.5]], dynamic=True)
    plan, dec = d.planner, FakeDec()
    plan.start(d, dec)
    plan.alpha = 1.0  # remember only the latest outcome
    dec.out = [1]  # the root; head 0 guesses output 1, head 1 output 2
    plan.observe(dec, 1, 2, 0.01, cands=[[5, 6], [7, 8]])
    assert plan.P == [[0.5, 1.0], [0.5, 1.0]]  # the prior: nothing resolved yet
    dec.out = [1, 6, 9]
    plan.observe(dec, 1, 2, 0.01, [0, 1], cands=[[1, 2], [3, 4]])
    assert plan.P[0] == [0.0, 1.0]  # output 1 was 6: head 0's rank 2
    assert plan.P[1] == [0.0, 0.0]  # output 2 was 9: not in head 1's top 2
    assert [q[0] for q in plan.pending[id(dec)]] == [3, 4]  # the latest guesses wait


def test_the_plan_is_redone_only_when_the_sequence_moves(monkeypatch):
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=13, intermediate_size=24)
    model = random_model(args, 0)
    d = ProPD(Heads(16, 13, 3).init_from(model.lm_head), medusa_tree(ACC, 6), ACC, dynamic=True,
              budgets=(1, 2, 6), replan=16)
    calls = []
    real = planner.tree_lengths
    monkeypatch.setattr(planner, "tree_lengths", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = generate(model, [1, 2, 3], d, max_new_tokens=64, eos_id=-1)
    assert len(out.tokens) == 64
    # until two sizes are measured the plan is retried each step; afterwards once per 16 tokens
    assert len(calls) <= 3 + 64 // 16 + 1 < out.steps
    assert sum(d.planner.used.values()) == out.steps


def test_its_own_planner_drafts_every_step_even_where_drafting_cannot_pay():
    """The paper's ProPD never takes an AR step: with rows so dear that the core planner
    plans AR, its sizes still draft: the core's by default, and those a CPU's layer hands it
    (tuning.probing.own_budgets), each filling fast mode's row buckets at B = 1, 2, 4, 8."""
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=13, intermediate_size=24)
    model = random_model(args, 0)
    d = ProPD(Heads(16, 13, 3).init_from(model.lm_head), medusa_tree(ACC, 6), ACC, dynamic=True,
              cost=FixedCost(1e-3, 1.0))
    assert 0 not in d.planner.budgets
    own_budgets(d)
    assert 0 not in d.planner.budgets and d.planner.budgets == [s for s in BUDGETS if s]
    assert all(B * (s + 1) in BUCKETS for s in d.planner.budgets for B in (1, 2, 4, 8) if B * (s + 1) <= 64)
    outs = generate(model, [[1, 2, 3], [4, 5]], d, max_new_tokens=24, eos_id=-1)
    assert d.planner.used[0] == 0 and sum(d.planner.used.values()) == max(o.steps for o in outs)
    core = planner.Planner(FixedCost(1e-3, 1.0))
    core.start(d, None)
    assert planner.best(core.lengths(), core.seconds) == 0  # the core planner would not draft


def test_early_head_training_reduces_the_loss():
    args = ModelArgs(dim=16, n_layers=3, n_heads=2, vocab_size=31, intermediate_size=24)
    model = random_model(args, 0)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 31, (4,), generator=g).tolist(), torch.randint(0, 31, (12,), generator=g).tolist())
            for _ in range(16)]
    data = [labelled(d) for d in data]
    x, y = samples(model, data, 1)

    def loss(head):
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(head(x), y))

    before = loss(EarlyHead(16, 31, 4, args.norm_eps).init_from(model))
    after = loss(train_early(model, data, 1, steps=30, rank=4, batch=64, lr=1e-2))
    assert after < before - 0.1


W = Path(__file__).parent.parent / "weights" / "pylm"


def test_k_keeps_most_right_tokens_or_pruning_is_off(monkeypatch):
    """The default k is the smallest whose held-out hit rate keeps KEEP of the right tokens (top-10
    after layer 2 of the default model); where none does, pruning is off and the report says so."""
    from nanospec.methods import propd
    model = load(W)
    d = ProPD.load(model, W)
    assert d.early is not None and d.k == 10 and d.early.hits[5] < propd.KEEP <= d.early.hits[10]
    assert ProPD.load(model, W, k=5).k == 5
    monkeypatch.setattr(propd, "KEEP", 0.9999)
    d = ProPD.load(model, W)
    assert d.early is None and "pruning off" in d.report() and "top-100" in d.report()


def test_early_heads_for_another_layer_are_refused():
    model = load(W)
    with pytest.raises(NanospecError, match="layers"):
        ProPD.load(model, W, layer=7)


def test_regression_last_row_of_the_block():
    """Found by hypothesis: the accepted node at the block's last row took silu's scalar tail
    path on CPU, 1.9e-6 off AR's logits (fixed by devices.CPU.elementwise)."""
    args = ModelArgs(dim=27, n_layers=3, n_heads=3, n_kv_heads=3, vocab_size=115, intermediate_size=35, head_dim=8,
                     rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_embeddings=True)
    seed = 3487
    model = random_model(args, seed)
    torch.manual_seed(seed)
    heads = Heads(args.dim, args.vocab_size, 3).init_from(model.lm_head)
    d = ProPD(heads, medusa_tree(ACC, 19), ACC, None, 1, 1, True, budgets=(1, 3, 19), replan=4)
    prompt = torch.randint(0, args.vocab_size, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
    check_exact(model, prompt, d, 24, dict(temperature=1.0, top_p=0.9, seed=seed), fast=False)
