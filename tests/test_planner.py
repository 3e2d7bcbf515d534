"""The draft budget (planner.py): ProPD's cost regression, acceptance tracking and expected length
(Figure 6), plans that follow what a row costs, and the budget shrinking to AR when drafting does
not pay; planned trees stay exact."""
import math
import random
import re
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import METHODS, Budgets, FixedCost, check_exact, drafter, feed, random_model
from nanospec import devices
from nanospec.costs import CostModel
from nanospec.engine import generate
from nanospec.methods import METHODS as REGISTRY
from nanospec.methods.medusa import Heads, Medusa
from nanospec.model import ModelArgs
from nanospec.planner import best, expected_lengths, tree_lengths
from nanospec.tree import choose_tree, product_paths
from nanospec.tuning.measured import Measured
from nanospec.tuning.probing import LONGEST, PROBE, SETTLE, SHARE, Probing
from nanospec.tuning.products import BUCKETS

ARGS = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=41, intermediate_size=40)
ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
NESTED = [n for n in METHODS if REGISTRY[n].nested]  # unranked drafters whose budget-s draft is a prefix (Lookahead's)


def test_regression_recovers_known_coefficients():
    cost = CostModel(alpha=1.0, lam=0.0)
    rng = random.Random(0)
    for _ in range(200):
        size = rng.choice([4, 8, 16, 32, 64])
        cost.update(size, 0.006 + 0.0002 * size)
    b0, b1 = cost.fit()
    assert b0 == pytest.approx(0.006) and b1 == pytest.approx(0.0002)
    assert cost.estimate(100) == pytest.approx(0.026)
    assert cost.fit(batch=4) is None  # batch sizes are kept apart


def test_recent_sizes_weigh_more():
    cost = CostModel(alpha=1.0, lam=1.0)
    cost.update(8, 1.0)        # old and off the line
    for _ in range(50):
        cost.update(16, 0.016)
        cost.update(32, 0.032)
    b0, b1 = cost.fit()
    assert abs(b0) < 1e-3 and b1 == pytest.approx(0.001, rel=0.05)


def test_a_measured_size_is_priced_at_its_own_steps_and_the_line_prices_the_rest():
    """ProPD's cost model: a (batch, rows) its steps ran is priced at what they took (pruning, a method's own rows
    included), here 60 ms where the line through every size says 54; a size not run, by the line."""
    cost = CostModel(alpha=1.0, lam=0.0)
    for rows, seconds in ((4, 0.010), (8, 0.020), (12, 0.030), (16, 0.060)):
        cost.update(rows, seconds)
    b0, b1 = cost.fit()
    assert cost.estimate(16) == 0.060 and b0 + b1 * 16 == pytest.approx(0.054)
    assert cost.estimate(10) == pytest.approx(b0 + b1 * 10) and cost.estimate(16, batch=2) is None
    assert cost.basis(16) == "its steps' realized price" and cost.basis(10) == "the fitted line"


def test_expected_length_matches_figure_6():
    # Figure 6 of the paper (values read back from its text): head 1 ranks 1-2 are right with
    # probability 0.6 and 0.1 ('b', 'c'), head 2 with 0.3 and 0.1 ('d', 'e'); l('ab') = 0.6,
    # l('abe') = 0.06, and the tree 'abd' + 'ac' expects 1 + 0.6 + 0.6 * 0.3 + 0.1 = 1.88.
    p = [[0.6, 0.1], [0.3, 0.1]]
    assert expected_lengths([(0,), (0, 0), (1,)], p)[-1] == pytest.approx(1.88)
    assert expected_lengths([(0,), (0, 1)], p)[-1] == pytest.approx(1.66)


def test_acceptance_ema_and_rank_probabilities():
    """P[d][k] is an EMA of "depth d's true token was in its top k+1"; p() the chance of rank k."""
    planner = Probing(FixedCost(0.01, 0.001), alpha=0.5)
    planner.start(SimpleNamespace(topk=[3], acc=[[0.0, 0.0, 0.0]]), None)
    dec = SimpleNamespace(out=[9])
    for out, cands, P in (([9, 7], [5, 7, 8], [0.0, 0.5, 0.5]),  # right at rank 2: top-2 and top-3
                          ([9, 7, 5], [5, 7, 8], [0.5, 0.75, 0.75]),
                          ([9, 7, 5, 1], [5, 7, 8], [0.25, 0.375, 0.375])):  # beyond the top 3
        planner.observe(dec, 1, 2, 0.01, cands=[cands])
        dec.out = out
        planner.observe(dec, 1, 2, 0.01)
        assert planner.P == [P]
    assert planner.p() == [[0.25, 0.125, 0.0]]


def test_plan_picks_the_best_speed():
    p = [[0.9, 0.05], [0.8, 0.05], [0.7, 0.05]]
    cheap_rows = CostModel()
    expensive_rows = CostModel()
    for size in (2, 4, 8, 16):
        cheap_rows.update(size, 0.010 + 0.00001 * size)
        expensive_rows.update(size, 0.010 + 0.005 * size)
    plan = lambda cost: best(tree_lengths(p, [1, 3, 7, 15]), lambda s: cost.estimate(s + 1))
    assert plan(cheap_rows) == 15  # rows are free: the biggest tree
    assert plan(expensive_rows) in (1, 3)
    assert CostModel().estimate(3) is None  # nothing measured yet
    assert math.isclose(expected_lengths([], p)[-1], 1.0)


def test_measured_costs_interpolate():
    c = Measured({1: 0.010, 4: 0.016, 16: 0.040})
    assert c.estimate(1) == pytest.approx(0.010) and c.estimate(2) == pytest.approx(0.012)
    assert c.estimate(10) == pytest.approx(0.028) and c.estimate(32) == pytest.approx(0.072)  # the last slope on
    bumpy = Measured({1: 0.010, 3: 0.030, 4: 0.020, 8: 0.025})  # 3 rows measured slower than 4
    assert bumpy.estimate(3) == pytest.approx(0.020) and bumpy.estimate(2) == pytest.approx(0.015)
    assert [bumpy.estimate(n) for n in range(1, 9)] == sorted(bumpy.estimate(n) for n in range(1, 9))


def test_fast_modes_padded_products_cost_their_bucket():
    """Fast mode runs a product of n rows at its bucket's row count (products.BUCKETS), so a forward of 9
    rows costs what 12 do, not a line between 8 and 12; past the last bucket products are not padded."""
    points = {1: 0.010, 8: 0.020, 12: 0.030, 64: 0.060, 128: 0.100}
    c = Measured(points, padded=True)
    assert c.estimate(9) == pytest.approx(0.030) and c.estimate(12) == pytest.approx(0.030)
    assert c.estimate(2) == pytest.approx(0.020) and c.estimate(96) == pytest.approx(0.080)
    assert Measured(points).estimate(9) == pytest.approx(0.0225)


def test_measured_forwards_are_padded_only_under_tuned_products(monkeypatch, tmp_path):
    """measured.measure prices rows by bucket where fast mode's tuned products pad them, and by a line
    in exact mode and under plain products; a cached measure reads back the same."""
    from nanospec.tuning import products
    from nanospec.tuning.measured import measure
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    model = random_model(ARGS)
    rows = BUCKETS[:4]
    assert not measure(model, rows=rows, context=8, reps=1).padded  # no tuned products
    dev = replace(devices.of("cpu"), forms=products.tune(model, reps=1))
    for again in (False, True):
        assert measure(model, rows=rows, context=8, reps=1, dev=dev).padded
        assert not measure(model, exact=True, rows=rows, context=8, reps=1, dev=dev).padded


def test_a_drafters_own_product_shapes_leave_the_row_costs_measured(monkeypatch, tmp_path):
    """measure keys its cache by the forms of the model's own products: a table with a drafter's shape added (a draft
    vocabulary's head) reads the measure back; a model product's form changed measures again."""
    from nanospec.tuning import measured, products
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    model, runs = random_model(ARGS), []
    table = products.tune(model, buckets=BUCKETS[:2], reps=1).table
    dev = lambda t: replace(devices.of("cpu"), forms=products.Forms(t))
    run = measured.Decoding.run
    monkeypatch.setattr(measured.Decoding, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    first = measured.measure(model, rows=BUCKETS[:2], context=8, reps=1, dev=dev(table)).forward(1)
    n = len(runs)
    assert measured.measure(model, rows=BUCKETS[:2], context=8, reps=1,
                            dev=dev({**table, (7, ARGS.dim, 1): ("linear", 1)})).forward(1) == first
    assert len(runs) == n  # read back, not measured
    key = next(iter(table))
    measured.measure(model, rows=BUCKETS[:2], context=8, reps=1, dev=dev({**table, key: ("linear", 2)}))
    assert len(runs) > n


def test_measured_row_costs_keep_their_shape_through_a_slow_spell(monkeypatch, tmp_path):
    """measured.measure prices a row count by its median share of a round, scaled to the fastest round: a slow spell
    over the last rounds, and one slow forward of the fastest round, leave the shape as it is (the fastest time of
    each count would price that forward's count 30% high). A fake clock: a forward of n rows takes 1 + n/4."""
    from nanospec.tuning import measured
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    clock, calls, rows = [0.0], [], (1, 2, 4, 8)

    def run(dec, block, embeds=None):
        calls.append(len(block))
        k = len(calls) - 1 - 1 - len(rows)  # after the prefill's forward and the warm-up round
        pace = 1.0 if 0 <= k < len(rows) and len(block) != 8 else 1.3  # round 1 fast but for 8 rows; then slow
        clock[0] += pace * (1 + len(block) / 4)

    monkeypatch.setattr(measured.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(measured.Decoding, "run", run)
    m = measured.measure(random_model(ARGS), rows=rows, context=8, reps=4)
    assert len(calls) == 1 + 5 * len(rows)
    assert [round(m.forward(n) / m.forward(1), 6) for n in rows] == [1.0, 1.2, 1.6, 2.4]


def test_a_step_costs_its_forward_and_what_steps_of_its_kind_took_beyond_it():
    """Measured learns, per batch size and kind of step (AR's or a drafter's), a step's excess over
    its forward: the median of the last steps, so one stall does not move it; bare leaves it out. A
    drafter's one-row step counts as drafting. A batch size not seen is priced at its forward alone,
    never at another size's excess; a size and budget seen OWN times, at what its steps took."""
    from nanospec.tuning.measured import OWN
    c = Measured({1: 0.010, 4: 0.016, 16: 0.040})
    assert c.estimate(4) == pytest.approx(0.016)  # nothing seen: the forward
    for _ in range(3):
        c.update(4, 0.016 + 0.030)
    c.update(4, 2.0)  # a stall
    c.update(1, 0.010 + 0.030)  # a drafter's step of one row (no draft yet) is a drafting step
    assert c.estimate(4) == pytest.approx(0.046) and c.estimate(10) == pytest.approx(0.058)
    assert c.estimate(4, bare=True) == pytest.approx(0.016)
    assert c.estimate(1) == pytest.approx(0.010)  # AR: nothing seen yet
    c.update(1, 0.011, ar=True)
    assert c.estimate(1) == pytest.approx(0.011)
    assert c.estimate(2, batch=2) == pytest.approx(0.012) and c.estimate(8, batch=2) == pytest.approx(0.024)
    c.update(8, 0.024 + 0.050, batch=2)
    assert c.estimate(8, batch=2) == pytest.approx(0.074) and c.estimate(4) == pytest.approx(0.046)  # per batch
    assert c.estimate(12, batch=3) == pytest.approx(c.forward(12))  # 2 and 4 seen, 3 not: its forward
    for _ in range(OWN):  # budget 3 at batch 2 costs 0.2 s: until OWN steps, its forward and excess price it
        assert c.estimate(8, batch=2, budget=3) == pytest.approx(c.forward(8) + c.excess[2, True])
        c.update(8, 0.2, batch=2, budget=3)
        c.update(8, 0.074, batch=2, budget=1)  # budget 1's steps keep the excess at 0.05
    assert c.estimate(8, batch=2, budget=3) == pytest.approx(0.2) and c.estimate(8, batch=2, budget=1) == 0.074
    assert c.estimate(8, batch=1, budget=3) == pytest.approx(c.estimate(8))  # another size's realized price: not its


def ranked(acc):
    """A stand-in ranked drafter: its prior acc per depth over 3 ranks, a row per node, one match length."""
    return SimpleNamespace(topk=[3] * len(acc), acc=acc, rows=lambda n, budget=None: n, allowed_paths=None,
                           match_length=lambda dec: 0)


def test_the_cost_model_learns_at_each_plan_and_a_kind_of_step_known_replans():
    """The planner hands its steps' times to the cost model when it plans (not on every step), and
    replans when a kind of step (batch size, AR or drafting) has run SETTLE times: its cost is known."""
    learnt = []
    cost = FixedCost(0.01, 0.001)
    cost.update = lambda *step: learnt.append(step)
    planner = Probing(cost, replan=1000)
    planner.start(ranked([[0.5, 0.1, 0.1]]), None)
    dec = SimpleNamespace(out=[], cur=0)
    for i in range(2 * SETTLE):
        size, _ = planner.budget([dec])
        assert len(learnt) == (0 if i < SETTLE else SETTLE)  # none at the first plan; the SETTLE steps at the next
        dec.out.append(i)
        dec.cur += 1
        planner.observe(dec, size, size + 1, 0.01 * (i + 1), cands=[[-1, -2, -3]] if size else None)
        assert (planner.at is None) == (i + 1 == SETTLE)  # the SETTLE-th step of its kind: replan
    assert [s[1] for s in learnt] == [0.01 * (i + 1) for i in range(SETTLE)] and all(s[2] == 1 for s in learnt)


def test_a_refill_does_not_stop_the_replans():
    """Continuous batching gives a stopped sequence's row to a new prompt, whose cursor starts at its
    prompt's length: the planner still replans every `replan` tokens (its own clock, not a cursor)."""
    planner = Probing(FixedCost(0.01, 0.001), replan=8)
    planner.start(ranked([[0.5, 0.1, 0.1]]), None)
    plans = []
    lengths = planner.lengths
    planner.lengths = lambda sure=False: plans.append(sure) or lengths(sure)
    for dec in (SimpleNamespace(out=[], cur=500), SimpleNamespace(out=[], cur=10)):  # the second: a refill
        before = plans.count(False)
        for i in range(40):
            size, _ = planner.budget([dec])
            dec.out.append(i)
            dec.cur += 1
            planner.observe(dec, size, size + 1, 0.01, cands=[[-1, -2, -3]] if size else None)
        assert plans.count(False) - before >= 40 // 8  # one plan in 8 tokens, after the refill too


def drive(planner, acc, steps, right, seconds=lambda rows, size: 0.01, B=1, ride=False) -> list[int]:
    """Plans `steps` steps of B sequences for a stand-in ranked drafter (acc: its prior per depth, 3
    ranks) whose output i is token i: a drafting step's candidates at depth k guess output n + k (n:
    the tokens after the step), right at top-1 where right(step, i); a step takes seconds(rows, size).
    A drafting step over the last step's candidates accepts their leading right top-1s, up to its
    size, as a chain would. ride: the drafts ride on the chain's end, as SDSAT's adaptive tokens do,
    so a step that stops short of it has none for the next (whose tree is then its root alone).
    The size of each step."""
    planner.start(ranked(acc), None)
    decs, sizes, last = [SimpleNamespace(out=[], cur=0) for _ in range(B)], [], [None] * B
    for step in range(steps):
        size, _ = planner.budget(decs)
        for b, dec in enumerate(decs):
            got = 0
            while size and last[b] and got < min(size, len(acc)) and last[b][got][0] != -1:
                got += 1
            dec.out += range(len(dec.out), len(dec.out) + got + 1)
            dec.cur += got + 1
            n = len(dec.out)
            cands = [[n + k if right(step, n + k) else -1, -2, -3] for k in range(len(acc))] if size else None
            if ride and last[b] and got < min(size, len(acc)):
                cands = None
            rows = B * (size + 1) if b == 0 else 0  # a batch's step is counted with its first sequence
            planner.observe(dec, size, rows, seconds(B * (size + 1), size), tuple(range(got + 1)), cands=cands)
            last[b] = cands
        sizes.append(size)
    return sizes


def test_drafting_that_costs_more_than_its_forward_goes_to_ar():
    """A drafter whose steps take 0.03 s beyond their forward (its heads, its own rows) and whose
    drafts get 0.6 tokens per step: worth a forward, not that. The planner learns the excess from
    the steps' times and plans AR; priced at the forward alone (no excess learnt), it drafts on."""
    for cost, ar in ((Measured({1: 0.010, 64: 0.020}), True), (FixedCost(0.00984, 0.00016), False)):
        planner = Probing(cost, replan=8)
        drive(planner, [[0.6, 0.1, 0.1], [0.4, 0.1, 0.1]], 100, lambda step, i: (i - 1) % 5 < 3,
              lambda rows, size: cost.forward(rows) + (0.03 if size else 0.0))
        assert (planner.chosen == 0) == ar and (planner.used[0] > 50) == ar


def test_choose_tree_keeps_to_the_allowed_paths():
    allowed = [(0,), (1,), (0, 0), (0, 1)]  # BiTA's efficient shape: only the top-1 has children
    assert choose_tree(ACC, 10, allowed) == [(0,), (0, 0), (1,), (0, 1)]
    assert choose_tree(ACC, 10)[:4] == [(0,), (0, 0), (1,), (0, 0, 0)]  # 0.2 > 0.6 * 0.5 * 0.4


def medusa(model, acc=ACC):
    return Medusa(Heads(ARGS.dim, ARGS.vocab_size, 3).init_from(model.lm_head), choose_tree(acc, 6), acc)


@pytest.mark.parametrize("base, row_cost, expect", [(0.01, 1e-6, "big"), (0.0, 1.0, "ar")])
def test_budgets_follow_what_a_row_costs(base, row_cost, expect):
    """Cheap rows: big trees; a step that costs only its rows (no tree beats AR even if every draft
    is right, so no probe either): AR steps (budget 0), and a planned method runs no extra rows."""
    model = random_model(ARGS, 1)
    d = medusa(model).plan(Probing(FixedCost(base, row_cost), replan=8))
    out = generate(model, [3, 4, 5], d, max_new_tokens=40, eos_id=-1)
    sizes = d.planner.used
    if expect == "big":
        assert max(sizes) >= 16 and sizes[0] == 0
    else:
        assert set(sizes) == {0} and out.steps == 40  # exactly AR's steps


def test_a_planned_ranked_drafter_may_use_every_rank_it_was_measured_at():
    """Planning widens a ranked drafter's candidates per depth to the ranks its accuracy table has
    (7 here), not to its number of heads (3)."""
    acc = [[0.5, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]] * 3
    d = Medusa(Heads(ARGS.dim, ARGS.vocab_size, 3), [(0,), (0, 0), (0, 0, 0)], acc)
    assert d.plan(Probing(FixedCost(0.01, 1e-5))).topk == [7, 7, 7]


def test_ar_steps_reuse_one_drafter(monkeypatch):
    """Budget-0 steps run the engine's one AR drafter (in exact mode on a GPU, one captured step
    program), not a new one per step."""
    from nanospec import engine
    model = random_model(ARGS, 1)
    d = medusa(model).plan(Probing(FixedCost(0.0, 1.0), replan=8))
    seen, program = [], engine.launch_step
    monkeypatch.setattr(engine, "launch_step",
                        lambda dec, drafter, *a: seen.append(drafter) or program(dec, drafter, *a))
    generate(model, [3, 4, 5], d, max_new_tokens=10, eos_id=-1)
    assert len(seen) == 10 and all(s is engine.AR for s in seen)


@pytest.mark.parametrize("name", METHODS)
def test_an_ar_step_under_any_method_is_ars_own_step(name, monkeypatch):
    """A budget of 0, alone and in a batch: every method's step launches the engine's AR with one row per sequence,
    the step AR itself launches (so the same program and ops); the output is AR's."""
    from nanospec import engine
    model = random_model(ARGS, 1)
    seen, program = [], engine.launch_step
    monkeypatch.setattr(engine, "launch_step", lambda decs, drafter, block, *a: seen.append(
        (drafter, tuple(block.tokens.shape))) or program(decs, drafter, block, *a))
    prompts = [[3, 4, 5], [7, 8, 9, 10]]
    for rows in (1, 2):
        ar = [o.tokens for o in generate(model, prompts, None, max_new_tokens=8, eos_id=-1, batch=rows)]
        ars, seen[:] = list(seen), []
        d = drafter(name, model)
        d.planner = Budgets([0])
        assert [o.tokens for o in generate(model, prompts, d, max_new_tokens=8, eos_id=-1, batch=rows)] == ar
        assert seen == ars and all(s is engine.AR and shape[1] == 1 for s, shape in seen)
        seen[:] = []


def test_the_budget_shrinks_to_ar_when_drafts_fail():
    """Candidates that are never right (random heads, a planner that starts hopeful): the acceptance
    estimates fall and the budget goes to 0, where a step costs what AR's does."""
    model = random_model(ARGS, 2)
    heads = Heads(ARGS.dim, ARGS.vocab_size, 3)
    torch.nn.init.normal_(heads.proj[0].weight, std=5.0)  # wrong guesses
    d = Medusa(heads, choose_tree(ACC, 6), [[0.9] * 3] * 3).plan(Probing(FixedCost(0.01, 0.002), replan=4, alpha=0.3))
    generate(model, [3, 4, 5], d, max_new_tokens=120, eos_id=-1)
    assert d.planner.chosen == 0 and d.planner.used[0] > 40


@pytest.mark.parametrize("row_cost", [1e-4, 1e-2])
def test_probes_cost_at_most_a_share_of_the_time_at_ar(row_cost):
    """AR steps teach the acceptance estimates nothing: while AR is planned, probes (PROBE drafting steps)
    renew them once AR has run long enough that a probe's extra cost is at most SHARE of that time. So
    where a drafting step costs little more than an AR step, a probe comes about every replan, and where
    it costs 1.5x as much (a one-node tree, two rows), about every 200 tokens; the cadence runs on
    across generations (three prompts here)."""
    model = random_model(ARGS, 2)
    heads = Heads(ARGS.dim, ARGS.vocab_size, 3)
    torch.nn.init.normal_(heads.proj[0].weight, std=5.0)  # wrong guesses: AR gets planned
    cost = FixedCost(0.01, row_cost)
    planner = Probing(cost, replan=16, alpha=0.3)
    d = Medusa(heads, choose_tree(ACC, 6), [[0.9] * 3] * 3).plan(planner)
    log = []  # (the step's size, the size planned for the replan period, its rows)
    observe = planner.observe
    planner.observe = lambda dec, size, rows, *a, **k: (log.append((size, planner.chosen, rows))
                                                        or observe(dec, size, rows, *a, **k))
    for prompt in ([3, 4, 5], [6, 7], [8]):
        generate(model, prompt, d, max_new_tokens=200, eos_id=-1)
    ar = [rows for size, _, rows in log if size == 0]
    probes = [rows for size, planned, rows in log if size and planned == 0]
    extra = sum(cost.estimate(r) - cost.estimate(1) for r in probes)
    assert len(ar) > 300 and len(probes) >= PROBE
    assert extra <= SHARE * cost.estimate(1) * len(ar) + extra / (len(probes) / PROBE)  # the first may come early
    assert len(probes) >= 15 * PROBE if row_cost < 1e-3 else len(probes) <= 4 * PROBE


def drifting(B: int, seed: int, ar: bool = False) -> float:
    """Tokens per second of B sequences whose drafts pay only with every 10th token right (a drafting step costs 6 ms a
    sequence beyond its forward), planned (ar: AR throughout), on a machine whose speed swings 25% either way once a
    minute, with 5% noise a step."""
    rng, clock, hits = random.Random(seed), [0.0], {}
    cost = Measured({1: 0.040, 2: 0.041, 3: 0.044, 4: 0.047, 6: 0.05, 8: 0.052, 12: 0.06, 16: 0.07, 32: 0.09})

    def seconds(rows, size):
        pace = (1 + 0.25 * math.sin(2 * math.pi * clock[0] / 60)) * math.exp(rng.gauss(0, 0.05))
        took = (cost.forward(rows) + (0.006 * B if size else 0.0)) * pace
        clock[0] += took
        return took

    planner = Probing(cost, replan=32)
    if ar:
        planner.choose = lambda: 0
    drive(planner, [[0.5, 0.0, 0.0]] * 3, 2000, lambda step, i: hits.setdefault(i, rng.random() < 0.1), seconds, B=B)
    return planner.clock / clock[0]


def unpaced(monkeypatch):
    """Planted: every price read at the pace its steps ran at (none decays as the machine drifts)."""
    update = Measured.update

    def held(self, *step, **how):
        update(self, *step, **how)
        self.pace = 1.0
        self.paces.clear()
    monkeypatch.setattr(Measured, "update", held)


@pytest.mark.parametrize("B", [1, 4])
def test_drafting_that_never_pays_costs_its_probes_alone_on_a_drifting_machine(B, monkeypatch):
    """Alone and in a batch, a drafter that never pays runs within its probes' SHARE (and 1%) of AR's pace while
    the machine's speed drifts: each price is the median of its recent steps, read at the machine's pace now, and a
    run of drafting that a probe's lucky outcomes planned is undone in SETTLE steps. Planted, each caught: alone,
    a price of its last step alone (measured.WINDOW = 1: 0.950 of AR's pace), or prices that do not decay as the
    machine drifts (0.963); at B = 4, a drafting run that lasts its replan period (0.956)."""
    from nanospec.tuning import measured, probing
    paces = lambda: [drifting(B, seed) / drifting(B, seed, ar=True) for seed in range(3)]
    assert min(paces()) >= 1 - SHARE - 0.01
    plants = [lambda: monkeypatch.setattr(measured, "WINDOW", 1), lambda: unpaced(monkeypatch)] if B == 1 else \
        [lambda: monkeypatch.setattr(probing, "SETTLE", 10 ** 9)]
    for plant in plants:
        plant()
        assert min(paces()) < 1 - SHARE - 0.01
        monkeypatch.undo()


def test_a_probe_that_finds_good_drafts_brings_drafting_back():
    """A ranked drafter whose candidates are all wrong for a stretch (AR gets planned), then right at
    top-1 on 3 of 5 tokens: a probe's outcomes replace the stale estimates, so drafting comes back at
    the first probe. An EMA nudged by a probe's few outcomes kept a SmolLM2 Medusa at AR for good."""
    planner = Probing(FixedCost(0.01, 0.004), budgets=(0, 1, 2, 4), replan=8)  # 3 rows cost 2.2x 1 row
    sizes = drive(planner, [[0.5, 0.1, 0.1]] * 2, 600, lambda step, i: step >= 300 and i % 5 < 3)
    bad, good = sizes[:300], sizes[300:]
    assert bad[-40:].count(0) >= 30  # wrong drafts: AR
    back = next(i for i in range(len(good)) if all(good[i:i + 20]))  # drafting again, for good
    s, ar = planner.seconds(planner.probe), planner.seconds(0)
    wait = min(max(planner.replan, PROBE * (s / ar - 1) / SHARE), LONGEST * planner.replan)
    assert back <= wait + planner.replan + PROBE  # the first probe of the good stretch


def test_a_probe_comes_sooner_the_closer_drafting_is_to_paying():
    """A probe is priced at its expected loss against AR (at most SHARE of the tokens at AR since the
    last drafting step). Drafts right a quarter of the time, where a third would break even, are
    probed three times as often as drafts never right, at the same costs (a probe's whole extra
    cost, the old price, probed both alike: 5 probes in 600 tokens)."""

    def drafting(hit) -> int:
        planner = Probing(FixedCost(0.01, 0.005), budgets=(0, 1, 2, 4), replan=8)  # 2 rows cost 4/3 of 1 row
        return sum(s > 0 for s in drive(planner, [[0.25, 0.0, 0.0]] * 2, 600, lambda step, i: hit(i)))

    near, far = drafting(lambda i: i % 4 == 0), drafting(lambda i: False)
    assert PROBE <= far <= 6 * PROBE and near > 2 * far


@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_a_probe_gathers_probe_candidate_lists_across_the_batch(B):
    """A probe's drafting steps gather PROBE candidate lists per depth, from its batch's sequences
    together: PROBE / B steps, not PROBE whatever the batch (at B = 8 eight times what the estimate
    needs, each step costing about an AR step more)."""
    planner = Probing(FixedCost(0.01, 0.0002), budgets=(0, 1, 2, 4), replan=8)
    sizes = drive(planner, [[0.2, 0.0, 0.0]] * 2, 1200 // B, lambda step, i: False, B=B)
    runs = [len(r) for r in "".join("d" if s else "." for s in sizes).split(".") if r]
    # the first: drafting at the prior; the last: cut short
    assert len(runs) >= 4 and set(runs[1:-1]) == {-(-PROBE // B)}


def test_a_probe_weighs_beside_the_history():
    """A probe's outcomes weigh as PROBE steps of the history: 8 right guesses move an estimate of
    0.2 to 0.6, not to 1 (a good stretch that a probe meets would plan drafting as if it always came)."""
    p = Probing(FixedCost(0.01, 0.001))
    p.start(SimpleNamespace(topk=[3], acc=[[0.2, 0.0, 0.0]], rows=lambda n, budget=None: n, allowed_paths=None), None)
    dec, p.probed = SimpleNamespace(out=[], cur=0), True
    for i in range(PROBE + 1):
        p.observe(dec, 1, 2, 0.01, cands=[[i, -1, -2]])  # a depth-0 candidate list that guesses output i
        dec.out.append(i)
    assert p.P[0][0] == pytest.approx(0.6)


@pytest.mark.parametrize("name", METHODS)
def test_a_planner_offers_no_more_than_a_methods_largest_draft(name):
    """A method that declares its largest draft (Drafter.max_draft) is never offered a larger budget, and its
    exact block holds that draft's rows, not the planner's largest budget's."""
    d = drafter(name, random_model(ARGS, 3))
    budgets = Probing(FixedCost(0.01, 1e-5)).budgets
    d.plan(Probing(FixedCost(0.01, 1e-5)))
    most = max(budgets) if d.max_draft is None else d.max_draft
    assert d.planner.budgets == sorted({min(s, most) for s in budgets}) and d.max_rows >= d.rows(most + 1, most)
    if d.max_draft is not None:
        assert d.max_rows == d.rows(most + 1, most) < d.rows(max(budgets) + 1, max(budgets))


@pytest.mark.parametrize("name", NESTED)
def test_a_nested_budget_from_its_own_gains(name):
    """A nested drafter has no ranked candidates: each budget is judged by the drafts it got accepted."""
    model = random_model(ARGS, 1)
    prompt = [5, 6, 7, 8] * 6
    ar = generate(model, prompt, max_new_tokens=48, eos_id=-1)
    d = feed(REGISTRY[name].load(model, None), [prompt], [ar])  # its context knows the continuation: long drafts pay
    d.plan(Probing(FixedCost(0.01, 1e-5), replan=8))
    steps = []
    observe = d.planner.observe
    d.planner.observe = lambda dec, size, rows, *a, **k: steps.append((size, rows)) or observe(dec, size, rows, *a, **k)
    out = generate(model, prompt, d, max_new_tokens=48, eos_id=-1)
    assert out.tokens == ar.tokens and max(d.planner.used) >= min(8, d.max_draft) and out.tokens_per_step > 3
    assert all(rows <= size + 1 for size, rows in steps if size)  # a budget caps the draft
    assert max(d.planner.gain.values()) > 3  # what a large budget got accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NESTED)
def test_a_planned_nested_drafter_is_exact(name, dtype, device):
    """Under a planner a nested drafter (Lookahead's trie, PLD's chain) drafts whole and the engine runs a prefix
    of the planned budget: the logits of every accepted position are still AR's, bitwise, at budgets of every size,
    AR's (0) and over its largest draft included (its context knows the continuation, so drafts are accepted)."""
    model = random_model(ARGS, 3, dtype, device)
    prompt = [5, 6, 7, 8] * 6
    ar = generate(model, prompt, max_new_tokens=40, eos_id=-1)
    d = feed(REGISTRY[name].load(model, None), [prompt], [ar])
    d.planner, steps = Budgets([1, 3, 0, 7, 16, 2]), []
    out = check_exact(model, prompt, d, 32, fast=dtype == torch.float32,
                      on_step=lambda dec, step: steps.append((step.budget, len(step.tree), len(step.whole))))
    assert out.tokens_per_step > 1.5 and {b for b, _, _ in steps} == {0, 1, 2, 3, 7, 16}
    assert all(n <= b + 1 for b, n, _ in steps) and any(n < whole for _, n, whole in steps)  # prefixes ran


def test_a_nested_draft_is_scored_at_every_budget():
    """Lookahead's budget-s draft is the first s nodes of its whole draft, which the engine hands the
    planner: once the output it guessed is known, it tells what every budget would have got, the
    budget the step ran or not. Here the output runs through nodes 2, 5 and 9."""
    from nanospec.tree import Tree
    parents = [-1, 0, 0, 1, 0, 2, 3, 4, 1, 5] + [0] * 7
    tree = Tree([50] + [10 + i for i in range(1, 17)], parents)
    want = {1: 0, 2: 1, 4: 1, 8: 2, 12: 3, 16: 3, 24: 3, 64: 3}
    p = Probing(FixedCost(0.01, 1e-4), budgets=(0, *want))
    p.start(SimpleNamespace(topk=None, nested=True, match_length=lambda dec: 0), None)
    dec = SimpleNamespace(out=[99, 12, 15, 19, 7])
    p.observe(dec, 16, 17, 0.01, [0, 2, 5, 9], tree)
    assert {s: p.gain[0, s] for s in want} == want and not p.drafts[id(dec)]
    p = Probing(FixedCost(0.01, 1e-4), budgets=(0, *want))
    p.start(SimpleNamespace(topk=None, nested=True, match_length=lambda dec: 0), None)
    dec = SimpleNamespace(out=[99, 12])
    p.observe(dec, 1, 2, 0.01, [0], tree)  # budget 1: node 1 is wrong; 12 is AR's token
    assert not p.gain and len(p.drafts[id(dec)]) == 1  # node 2 has a child: the output so far cannot tell
    dec.out += [15, 19, 7]
    p.observe(dec, 0, 1, 0.01)  # later steps bring the output
    assert {s: p.gain[0, s] for s in want} == want and not p.drafts[id(dec)]


def test_unlucky_first_steps_do_not_lock_a_budget_out():
    """A nested drafter whose first 3 drafts are all wrong and whose drafts pay from budget 13 on
    (node 1, then a chain at nodes 8..13): scored at every budget, the whole drafts show it at once,
    whatever budgets the steps ran."""
    from nanospec.tree import Tree

    def whole(i, seq):  # 16 nodes under the root: wrong tokens, but for the chain 1, 8..13 when good
        tokens, parents = [seq[0]] + [-j for j in range(1, 17)], [-1] + [0] * 16
        for k, j in enumerate([1, 8, 9, 10, 11, 12, 13] if i >= 3 else []):
            tokens[j], parents[j] = seq[1 + k], [0, 1, 8, 9, 10, 11, 12][k]
        return Tree(tokens, parents)
    late = [s for _, s in nested_run(Probing(FixedCost(0.01, 1e-4)), lambda i: 0, whole, steps=400)][200:]
    assert sum(s >= 13 for s in late) > 0.8 * len(late)


def test_a_nested_budget_is_priced_at_the_nodes_its_drafts_run():
    """A budget caps a nested draft; a shorter draft runs whole. A trie that matches one step in four,
    then drafts 3 right tokens, and otherwise nothing (the root alone, an AR step's cost): priced at
    its full budget, drafting loses to AR (1.75 tokens for 5 rows); priced at the 1.75 nodes its
    drafts run, it pays, and the planner drafts."""
    from nanospec.tree import Tree
    late = [s for _, s in nested_run(Probing(FixedCost(0.01, 0.004)), lambda i: 0,
                                     lambda i, seq: Tree.chain(seq[0], seq[1:4] if i % 4 == 0 else []),
                                     steps=400)][200:]
    assert sum(s >= 3 for s in late) > 0.8 * 200


def nested_run(p, context, whole, steps=200) -> list[tuple[int, int]]:
    """Steps of a stand-in nested drafter over a world whose output i is token 1000 + i, one sequence
    (its Decoding persists, as the engine's does): context(i) and whole(i, seq) give step i's context
    and whole draft, seq the last token and the 16 after it. (context, size) of each step."""
    world = list(range(1000, 9000))
    p.start(SimpleNamespace(topk=None, nested=True, rows=lambda n, budget=None: n,
                            match_length=lambda dec: context(dec.i)), None)
    dec, out = SimpleNamespace(cur=1, out=[], i=0), []
    for dec.i in range(steps):
        s, _ = p.budget([dec])
        tree = whole(dec.i, world[dec.cur - 1:dec.cur + 16])
        path = tree.prefix(min(len(tree), s + 1)).follow(world[dec.cur:dec.cur + 20])
        rows = min(len(tree), s + 1)
        dec.cur += len(path)
        dec.out = world[1:dec.cur]
        p.observe(dec, s, rows, p.cost.estimate(rows), path, tree)
        out.append((context(dec.i), s))
    return out


def test_a_trie_match_plans_its_own_budget():
    """Lookahead's gains are kept per match length (how long a suffix its trie matched): here one step in
    two matches long and drafts 16 right tokens, the other matches short and only its first node is
    right. Pooled, one budget serves both (16); per match length, the short match drafts 1 node."""
    from nanospec.tree import Tree

    def whole(i, seq):  # a chain of the next 16 tokens, wrong after the first on short matches
        return Tree.chain(seq[0], seq[1:] if i % 2 else seq[1:2] + [-t for t in seq[2:]])
    steps = nested_run(Probing(FixedCost(0.01, 0.002)), lambda i: 2 if i % 2 else 1, whole)[50:]
    assert all(s == 1 for c, s in steps if c == 1) and all(s >= 16 for c, s in steps if c == 2)


def test_a_nested_draft_is_scored_on_ar_steps_too():
    """An AR step runs the root alone, but a nested drafter still drafts whole and the planner scores
    the draft once the output is known: after a stretch where drafts failed (AR planned), drafts that
    turn right are taken up as soon as the output shows it (16 AR steps), with no probe (a probe runs the smallest
    budget, 1)."""
    from nanospec.tree import Tree
    p = Probing(FixedCost(0.01, 0.002))
    p.gain, p.nodes, p.tries = ({(0, s): 0.0 for s in p.budgets}, {(0, s): 1.0 for s in p.budgets},
                                Counter({(0, s): 99 for s in p.budgets}))
    sizes = [s for _, s in nested_run(p, lambda i: 0, lambda i, seq: Tree.chain(seq[0], seq[1:]), steps=30)]
    assert sizes[0] == 0 and 1 not in sizes and min(sizes[-4:]) >= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_cost", [1e-5, 2e-3])
def test_planned_trees_are_exact(dtype, row_cost, device):
    """Exact with the planner's trees: big ones where rows are cheap; where a row costs 20% of a step,
    trees whose size changes within the exact run as the acceptance estimates leave the prior (2, then 1)."""
    model = random_model(ARGS, 4, dtype, device)
    d = medusa(model).plan(Probing(FixedCost(0.01, row_cost), replan=4))
    d.heads.to(device=device, dtype=dtype)
    runs, start, budget = [], d.planner.start, d.planner.budget  # each run's step sizes; runs[0]: exact mode's
    d.planner.start = lambda *a: runs.append([]) or start(*a)
    d.planner.budget = lambda *a: (b := budget(*a), runs[-1].append(b[0]))[0]
    out = check_exact(model, [1, 2, 3, 4], d, 32, fast=dtype == torch.float32, peeking=0.9, seed=1)
    assert out.tokens_per_step >= 1.5 and (max(runs[0]) >= 16 if row_cost < 1e-3 else len(set(runs[0])) >= 2)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 40), st.randoms(use_true_random=False))
def test_best_trees_nest(K, R, s, rnd):
    """plan() searches once at the largest size and takes prefixes: the best s-node tree must be the
    first s paths of the best larger one (ties included), with any allowed paths."""
    acc = [[rnd.choice([0.0, 0.1, 0.25, 0.5, rnd.random()]) for _ in range(R)] for _ in range(K)]
    allowed = None if rnd.random() < 0.5 else product_paths([rnd.randint(1, R) for _ in range(K)])
    assert choose_tree(acc, s, allowed) == choose_tree(acc, 64, allowed)[:s]


def test_the_lengths_are_calibrated_by_what_drafting_steps_got(monkeypatch):
    """Drafts that ride on the chain's end (SDSAT's adaptive tokens): a step that stops short of it
    leaves the next step its root alone, which Figure 6's lengths leave out. Where that makes drafting
    lose to AR, the calibrated planner goes to AR (probes aside) and beats AR's pace within a few
    percent, where the model's own lengths draft on; where drafting pays, it drafts on. Planted fault:
    the calibration held at 1."""

    def run(b1, p0, calibrated):
        rng, hits, log = random.Random(0), {}, []
        planner = Probing(FixedCost(0.01, b1), budgets=(0, 1, 2, 4), replan=8)
        if not calibrated:
            monkeypatch.setattr(planner, "calibration", lambda: 1.0)
        observe = planner.observe
        planner.observe = lambda dec, size, rows, secs, path, **k: (log.append((len(path), secs))
                                                                     or observe(dec, size, rows, secs, path, **k))
        sizes = drive(planner, [[p0, 0.0, 0.0]] * 2, 1500, lambda step, i: hits.setdefault(i, rng.random() < p0),
                      lambda rows, size: 0.01 + b1 * rows, ride=True)
        pace = sum(n for n, _ in log) / sum(s for _, s in log) * (0.01 + b1)  # tokens per AR step's time
        return sum(s > 0 for s in sizes[500:]) / 1000, pace

    (drafts, pace), (fault, fault_pace) = run(0.006, 0.5, True), run(0.006, 0.5, False)
    assert drafts < 0.45 < 0.6 < fault and pace > 0.98 and pace > fault_pace + 0.01
    drafts, pace = run(0.002, 0.7, True)
    assert drafts > 0.9 and pace > 1.3


def shrinking(planner, acc, stops, right, seconds) -> list[tuple]:
    """drive's stand-in drafter over a batch whose sequences stop at their `stops` tokens (its tail runs smaller
    sizes, as continuous batching's last prompts do); a step of B live sequences takes seconds(B, size). Per step:
    (B, size, whether a probe ran it, its seconds, tokens per sequence)."""
    planner.start(ranked(acc), None)
    decs, last, log = [SimpleNamespace(out=[], cur=0, stop=s) for s in stops], {}, []
    for step in range(10 ** 6):
        if not decs:
            return log
        size, _ = planner.budget(decs)
        B, secs, tokens = len(decs), seconds(len(decs), size), 0
        for b, dec in enumerate(decs):
            got, prev = 0, last.get(id(dec))
            while size and prev and got < min(size, len(acc)) and prev[got][0] != -1:
                got += 1
            dec.out += range(len(dec.out), len(dec.out) + got + 1)
            n, tokens = len(dec.out), tokens + got + 1
            last[id(dec)] = [[n + k if right(n + k) else -1, -2, -3] for k in range(len(acc))] if size else None
            planner.observe(dec, size, B * (size + 1) if b == 0 else 0, secs, tuple(range(got + 1)),
                            cands=last[id(dec)])
        log.append((B, size, planner.probed, secs, tokens / B))
        decs = [d for d in decs if len(d.out) < d.stop]


FORWARD = {1: 0.040, 2: 0.041, 3: 0.044, 4: 0.047, 6: 0.05, 8: 0.052, 12: 0.06, 16: 0.07, 32: 0.09, 64: 0.13}


def batched_machine(extra=lambda B, size: 0.002 if B == 1 else 0.04 * B):
    """A machine whose drafting steps cost extra(B, size) beyond their forward: alone a little (its heads), in a batch
    0.04 s a sequence (a batch's drafting is dear here). A step's seconds(B, size), with 2% noise."""
    rng, cost = random.Random(0), Measured(FORWARD)
    return lambda B, size: (cost.forward(B * (size + 1)) + (extra(B, size) if size else 0.0)) * rng.uniform(0.98, 1.02)


def borrowed(self, rows, batch=1, bare=False, budget=None):
    """Planted: the old price of a size not seen, the nearest seen size's excess per sequence."""
    kind = rows > batch
    seen = [b for b, k in self.excess if k == kind]
    b = min(seen, key=lambda b: (abs(b - batch), -b), default=None)
    return self.forward(rows) + (0.0 if bare or b is None else self.excess[b, kind] * batch / b)


def test_a_drafter_that_pays_alone_and_loses_at_4_drafts_alone_and_takes_ar_steps_at_4(monkeypatch):
    """Four sequences, three stopping at 200 tokens and one at 600: drafts right at top-1 on 3 tokens in 5 pay
    alone and lose at B = 4 (a batch's drafting steps are dear). Each live size is priced by its own steps: at 4
    the batch takes AR steps (probes aside), and its tail, alone, drafts. Planted: a size not seen yet priced at
    the nearest seen size's excess per sequence, the tail alone takes B = 4's drafting price and runs AR steps."""

    def run():
        rng, hits = random.Random(1), {}
        log = shrinking(Probing(Measured(FORWARD), replan=16), [[0.6, 0.1, 0.1]] * 3, (200, 200, 200, 600),
                        lambda i: hits.setdefault(i, rng.random() < 0.6), batched_machine())
        share = lambda B: sum(1 for b, s, probe, *_ in log[10:] if b == B and s and not probe) / \
            sum(1 for b, *_ in log[10:] if b == B)
        return share(4), share(1)

    at4, alone = run()
    assert at4 < 0.05 and alone > 0.9  # (0.0 and 1.0)
    monkeypatch.setattr(Measured, "estimate", borrowed)
    at4, alone = run()
    assert not alone > 0.9  # (0.72)


def test_a_drafter_whose_step_costs_more_than_its_tree_says_is_caught_by_its_realized_price(monkeypatch):
    """A drafter whose own rows cost beyond its tree's forward, the more the larger its budget (8 ms a draft node:
    adaptive rows, masks), alone, drafts right at top-1 on 7 tokens in 10: budgets 2 and 3 pay most (1.46x and 1.42x
    AR's pace), 1 and 5 less. Each budget run OWN times is priced at what its steps took, so the planner settles on
    2 and 3 (its first budget's excess sends it to AR until a probe measures budget 1). Planted: the realized price
    ignored (a budget priced at its forward and the median excess of whatever drafting ran lately), it sees no
    budget's own price and stays at AR but for probes and their short runs (1.02x)."""

    def run():
        rng, hits = random.Random(2), {}
        log = shrinking(Probing(Measured(FORWARD), replan=16), [[0.7, 0.1, 0.1]] * 4, (1500,),
                        lambda i: hits.setdefault(i, rng.random() < 0.7), batched_machine(lambda B, s: 0.008 * s))
        late = Counter(s for _, s, *_ in log[-500:])
        pace = sum(n for *_, n in log) / sum(t for *_, t, _ in log) * FORWARD[1]  # against AR's
        return pace > 1.2 and late[2] + late[3] > 0.8 * 500

    assert run()
    real = Measured.estimate
    monkeypatch.setattr(Measured, "estimate", lambda self, rows, batch=1, bare=False, budget=None:
                        real(self, rows, batch, bare))
    assert not run()


@pytest.mark.parametrize("B", [1, 4])
def test_probes_at_a_size_where_drafting_loses_cost_at_most_their_share(B, monkeypatch):
    """The probes' bound (tuning/probing.py): where drafting loses (drafts right at top-1 on 1 token in 10, their
    steps 10 ms a sequence beyond their forward), the probes' realized loss against AR (their time, less what AR would
    take for their tokens) is at most SHARE of the time at AR, plus the first probe. Planted: a probe priced at a
    third of its loss, they come three times as often, and cost more."""

    def bound() -> tuple[bool, int, float]:
        rng, hits = random.Random(3), {}
        log = shrinking(Probing(Measured(FORWARD), replan=16), [[0.6, 0.1, 0.1]] * 3, (800,) * B,
                        lambda i: hits.setdefault(i, rng.random() < 0.1), batched_machine(lambda B, s: 0.01 * B))
        ar, span = FORWARD[B], -(-PROBE // B)  # an AR step's seconds at B (2% noise aside); a probe's steps
        losses = [t - n * ar for _, s, probe, t, n in log if probe]
        at_ar, total = sum(t for _, s, _, t, _ in log if not s), sum(t for *_, t, _ in log)
        return sum(losses) <= SHARE * at_ar + sum(losses[:span]), len(losses) // span, at_ar / total

    holds, probes, share = bound()
    assert holds and probes >= 3 and share > 0.8  # AR planned but for its first steps and the probes
    loss = Probing.loss
    monkeypatch.setattr(Probing, "loss", lambda self, size, steps: loss(self, size, steps) / 3)
    assert not bound()[0]


def test_the_ledger_keeps_what_the_planner_expected_and_got_per_live_size():
    """Per live batch size and kind of step, the planner's ledger holds the tokens per second its plans expected and
    those its steps got (--profile prints them): a batch of 4 that takes AR steps and whose tail, alone, drafts;
    where a step's price is its own realized one, the expected speed is near the realized."""
    rng, hits = random.Random(1), {}
    p = Probing(Measured(FORWARD), replan=16)
    log = shrinking(p, [[0.6, 0.1, 0.1]] * 3, (100, 100, 100, 400), lambda i: hits.setdefault(i, rng.random() < 0.6),
                    batched_machine())
    for (B, drafting), (steps, tokens, secs, want, want_s) in p.ledger.items():
        mine = [(n * b, t) for b, s, _, t, n in log if b == B and bool(s) == drafting]
        assert steps == len(mine) and tokens == pytest.approx(sum(n for n, _ in mine))
        assert secs == pytest.approx(sum(t for _, t in mine))
    steps, tokens, secs, want, want_s = p.ledger[1, True]
    assert {(4, False), (1, True)} <= set(p.ledger) and want / want_s == pytest.approx(tokens / secs, rel=0.15)
    text = p.profile("stand-in")
    assert "[profile] stand-in's planner, B = 4, AR: " in text and "B = 1, drafting" in text
    assert f"realized {tokens / secs:.1f} tokens/s" in text


def test_profile_and_show_name_the_planners_prices(capsys, monkeypatch):
    """--bench --profile prints each planned method's ledger per live batch size; --show's header names the price
    the step's plan used."""
    from nanospec import bench
    from nanospec.show import Show
    model = random_model(ARGS, 1)
    monkeypatch.setattr(bench, "host_profile", lambda *a: "")
    d = medusa(model).plan(Probing(Measured(FORWARD), replan=8))
    bench.bench(model, [[3, 4, 5], [6, 7]], [d], max_new_tokens=12, eos_id=-1, profile=True, batch=2)
    err = capsys.readouterr().err
    assert "[profile] medusa's planner, B = 2, " in err and "realized" in err
    heads = []
    show = Show(str, d, out=None)
    generate(model, [3, 4, 5], d, max_new_tokens=12, eos_id=-1,
             on_step=lambda dec, step: heads.append(show.header(dec, step)))
    assert all(re.search(r"budget \d+( \(an AR step\))?, (priced [\d.]+ ms a step for [\d.]+ tokens a sequence "
                         r"\(its (steps' realized price|forward alone|forward and its kind's excess)\)|no price yet)",
                         h) for h in heads), heads
    assert any("priced" in h for h in heads)
