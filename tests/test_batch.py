"""Batches: every sequence of a batch decodes as it would alone. In exact mode its accepted logits
are bitwise those of the same prompt decoded alone by AR, whatever its batch-mates (their number,
lengths, methods' acceptance, stops); in fast mode its tokens are. Planted faults (a sequence that
reads its neighbour's cache slot, a sequence's rows one position off, a refilled row that sees its
predecessor's key) are caught. With fewer cache rows than prompts, a stopped sequence's row takes the
next prompt (continuous batching), and the same holds."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import helpers
from helpers import ARGS, DRAFTING, FAMILIES, METHODS, check_batch, drafter, each_method, family_args, random_model
from nanospec import engine, forward
from nanospec.drafter import Drafter
from nanospec.engine import Decoding, generate
from nanospec.methods import METHODS as REGISTRY

OWN_ROWS = [n for n in METHODS if REGISTRY[n].groups is not Drafter.groups]  # rows after the tree: masks, pseudo...

prompt_lists = st.lists(st.lists(st.integers(0, ARGS.vocab_size - 1), min_size=1, max_size=14), min_size=1, max_size=5)


@pytest.mark.parametrize("name", METHODS)
@each_method(25)
@given(prompts=prompt_lists, n=st.integers(1, 24), seed=st.integers(0, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), exact=st.booleans(), sampled=st.booleans(),
       rows=st.none() | st.integers(1, 4), family=st.sampled_from(FAMILIES), window=st.integers(1, 12))
def test_each_sequence_of_a_batch_decodes_as_alone(device, name, prompts, n, seed, dtype, exact, sampled, rows, family,
                                                   window):
    """Greedy, or sampled: each sequence draws from its own stream, the one it draws from alone; all
    prompts at once, or `rows` at a time, each stopped one's row refilled with the next prompt. Any family."""
    # fast bf16: near-ties
    args = family_args(ARGS, family, window)
    model = random_model(args, seed=seed, dtype=dtype if exact else torch.float32, device=device)
    d = drafter(name, model, seed)
    sampling = dict(temperature=1.0, top_p=0.9, seed=seed) if sampled else None
    check_batch(model, prompts, d, n, exact, peeking=0.9, seed=seed, sampling=sampling, rows=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["ar", "medusa"])
def test_a_full_batch_of_eight_is_bitwise_each_alone(device, dtype, name):
    """Eight sequences of one forward (8 x Q rows per product): each row's bits as in AR's Q-row block alone."""
    model = random_model(ARGS, seed=2, dtype=dtype, device=device)
    prompts = [[(7 * i + j) % ARGS.vocab_size for j in range(1 + 3 * i)] for i in range(8)]
    check_batch(model, prompts, drafter(name, model), 24, peeking=0.9)


@pytest.mark.parametrize("name", DRAFTING)
def test_batch_mates_of_every_kind_leave_a_sequence_alone(device, name):
    """One fixed batch: lengths 1 to 30, an EOS that stops some early, drafts that are accepted."""
    model = random_model(ARGS, seed=3, device=device)
    prompts = [[7], [1, 2, 3, 4] * 7, [9, 8, 7, 6, 5 + 1], [11, 12] * 3, [20 + i for i in range(30)]]
    out = check_batch(model, prompts, drafter(name, model), 40, peeking=0.9)
    assert sum(len(o.tokens) for o in out) > sum(o.steps for o in out)  # drafts were accepted


def test_a_sequence_reading_its_neighbours_slot_is_caught(monkeypatch, device):
    model = random_model(ARGS, seed=1, device=device)
    prompts = [[3, 9, 4, 1], [8, 2, 6, 10, 11]]
    check_batch(model, prompts, drafter("medusa", model), 12)
    attend = forward.attend_exact

    def leaky(q, kv, ctx):
        if q.shape[0] > 1:  # sequence 0 sees sequence 1's key at slot 0
            kv = kv.clone()
            kv[0, 0, :, 0] = kv[0, 1, :, 0]
        return attend(q, kv, ctx)
    monkeypatch.setattr(forward, "attend_exact", leaky)
    with pytest.raises(AssertionError, match="sequence 0"):
        check_batch(model, prompts, drafter("medusa", model), 12)


def test_rows_one_position_off_are_caught(monkeypatch, device):
    model = random_model(ARGS, seed=1, device=device)
    prompts = [[3, 9, 4, 1], [8, 2, 6, 10, 11], [4, 4]]
    lay_out = engine.lay_out

    def shifted(decs, drafter, trees, budget=None):
        block, batch, cache_rows = lay_out(decs, drafter, trees, budget)
        if block.pos.shape[0] > 1:
            block.pos[1] += 1
        return block, batch, cache_rows
    monkeypatch.setattr(engine, "lay_out", shifted)
    with pytest.raises(AssertionError, match="sequence 1"):
        check_batch(model, prompts, None, 12)


@pytest.mark.parametrize("name", METHODS)
def test_refilled_rows_decode_as_alone(device, name):
    """Seven prompts through two cache rows: rows are refilled five times, a stopped sequence's stale
    keys left behind in its row, and every sequence is still bitwise AR alone."""
    model = random_model(ARGS, seed=4, device=device)
    prompts = [[(5 * i + j) % ARGS.vocab_size for j in range(1 + 4 * (i % 3))] for i in range(7)]
    check_batch(model, prompts, drafter(name, model), 16, peeking=0.9, rows=2)


def test_a_refilled_row_that_sees_its_predecessors_key_is_caught(monkeypatch, device):
    model = random_model(ARGS, seed=1, device=device)
    prompts = [[3, 9, 4, 1], [8, 2, 6, 10, 11], [4, 4, 7]]
    check_batch(model, prompts, None, 12, rows=2)
    prefill, used, batching, real = Decoding.prefill, set(), [False], generate

    def tell(model, prompt, *a, **k):  # which run check_batch makes: a lone run's cache may have rows to spare too
        batching[0] = isinstance(prompt[0], list)
        return real(model, prompt, *a, **k)

    def stale(self, tokens):  # a refilled row starts one slot in: slot 0 keeps its predecessor's key
        if batching[0]:  # the batch's rows, not a lone run's
            self.cur = int(self.cache_row in used)
            used.add(self.cache_row)
        prefill(self, tokens)
    monkeypatch.setattr(helpers, "generate", tell)  # check_batch's runs
    monkeypatch.setattr(Decoding, "prefill", stale)
    with pytest.raises(AssertionError, match="sequence 2"):
        check_batch(model, prompts, None, 12, rows=2)


@pytest.mark.parametrize("name", OWN_ROWS)
def test_trees_of_different_sizes_share_one_forward(monkeypatch, device, name):
    """A method that adds rows after its tree (mask groups, pseudo states, adaptive tokens) gives a
    batch's smaller trees filler nodes up to the largest: one forward per step however the sizes
    differ (refilled rows start from a lone root beside full trees; SDSAT's sequences fall out of
    step), and every sequence still decodes as alone."""
    model = random_model(ARGS, seed=3, device=device)
    prompts = [[7], [1, 2, 3, 4] * 7, [9, 8, 7, 6], [11, 12] * 3, [4, 4, 7]]
    rounds, fit, program = [], Decoding.fit, engine.launch_step  # per round of the loop: [tree sizes, forwards]

    def fitted(dec, s, tree, budget=None):
        if not rounds or rounds[-1][1]:
            rounds.append([[], 0])
        rounds[-1][0].append(len(tree))
        return fit(dec, s, tree, budget)

    def programmed(*a):
        rounds[-1][1] += 1
        return program(*a)
    monkeypatch.setattr(Decoding, "fit", fitted)
    monkeypatch.setattr(engine, "launch_step", programmed)
    for seed in range(4):  # a seed's accepted drafts may keep the sequences in step, stopping together: another's not
        check_batch(model, prompts, drafter(name, model, seed), 24, peeking=0.7, seed=seed, rows=3)
        if any(len(set(sizes)) > 1 for sizes, _ in rounds):
            break
    assert any(len(set(sizes)) > 1 for sizes, _ in rounds), "no step met trees of different sizes"
    assert all(forwards == 1 for _, forwards in rounds), "a step ran more than one forward"


def test_a_full_batch_reads_its_cache_in_place(monkeypatch, device):
    """After refills, a step over every cache row keeps the rows in cache order, so attention reads
    each sequence's keys where they lie (cache_rows None) instead of gathering a copy of the whole cache
    per layer, which slowed a full batch's steps (RESULTS.md, "Why the heuristics stay")."""
    model = random_model(ARGS, seed=2, device=device)
    prompts = [[1 + i, 2 + i] * (1 + i) for i in range(7)]
    full, lay_out = [], engine.lay_out

    def spy(decs, drafter, trees, budget=None):
        block, batch, cache_rows = lay_out(decs, drafter, trees, budget)
        if len(decs) == 3:
            full.append(cache_rows)
        return block, batch, cache_rows
    monkeypatch.setattr(engine, "lay_out", spy)
    outs = check_batch(model, prompts, drafter("lookahead", model), 16, peeking=0.9, rows=3)
    assert len({o.steps for o in outs}) > 1, "the sequences stopped together: no refill out of order"
    assert len(full) > 4 and all(s is None for s in full), "a full batch gathered its cache rows"
