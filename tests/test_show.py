"""decode.py --show: each step drawn as the tree it verified, the accepted path marked as the tokens it committed, and
a run's output as without it."""
import pytest

from helpers import Adversary, call, decode_main, random_model, run_cli
from nanospec import engine
from nanospec.engine import generate
from nanospec.model import ModelArgs
from nanospec.show import draw


def preorder(tree, node=0, depth=0):
    """(node, depth) of the tree's drafted nodes under node, each before its children, children in index order."""
    for child in (i for i, p in enumerate(tree.parents) if p == node):
        yield child, depth + 1
        yield from preorder(tree, child, depth + 1)


@pytest.mark.parametrize("exact", [False, True])
def test_drawn_tree_is_the_verified_one(monkeypatch, exact):
    """On a planted drafter (random trees mixing AR's continuation with wrong branches), the tree on_step gets is the
    one the step laid out and verified, its drawing has a line per drafted node, and the marked nodes are the tokens
    the step committed, then the bonus: every step's, in order, make the output."""
    model = random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=48))
    prompt, n = [3, 14, 15, 9, 2, 6], 24
    truth = generate(model, prompt, max_new_tokens=n, exact=exact, eos_id=-1).tokens
    verified, shown, real = [], [], engine.lay_out

    def lay_out(decs, drafter, trees, budget=None):
        verified.append(trees[0])
        return real(decs, drafter, trees, budget)
    monkeypatch.setattr(engine, "lay_out", lay_out)
    out = generate(model, prompt, Adversary(truth, 50, seed=1), max_new_tokens=n, exact=exact, eos_id=-1,
                   on_step=lambda dec, *step: shown.append(step))
    assert out.tokens == truth and len(shown) == len(verified) == out.steps
    emitted = []
    for tree, (shown_tree, path, tokens, budget, rows) in zip(verified, shown):
        assert shown_tree is tree and rows == len(tree) and budget is None
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert [tree.tokens[i] for i in path[1:]] == tokens[:-1] and len(tokens) == len(path)
        lines = draw(tree, path, tokens, str)
        drawn = [(line.index("-") // 3, line.split()[-2 if line.endswith(" *") else -1]) for line in lines[1:-1]]
        marked = [line.split()[-2] for line in lines[1:-1] if line.endswith(" *")]
        assert lines[0] == str(tree.tokens[0]) and drawn == [(d, str(tree.tokens[i])) for i, d in preorder(tree)]
        assert marked == [str(t) for t in tokens[:-1]] and lines[-1].split()[1] == str(tokens[-1])
        emitted += tokens
    assert emitted[:n] == truth and sum(len(p) > 1 for _, p, *_ in shown) > 0  # some drafts were accepted


def test_draw_indents_children_under_their_parent():
    tree = engine.Tree([7, 1, 2, 3, 4], [-1, 0, 1, 1, 0])
    assert draw(tree, [0, 1, 3], [1, 3, 9], str) == [
        "7", "  +- 1 *", "  |  +- 2", "  |  `- 3 *", "  `- 4", "  => 9 (bonus: the model's own next token)"]
    painted = draw(tree, [0, 4], [4, 5], str, colour=True)
    assert "\033[1;32m4 *\033[0m" in painted[4] and "\033[2m1\033[0m" in painted[1]


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_output_as_without_show(mode):
    """The default model's Medusa: stdout with --show 2 is stdout without it, and stderr draws 2 steps."""
    args = ("--method", "medusa", "--max-new-tokens", 12, "--mode", mode)
    code, plain, _ = call(decode_main, *args)
    shown_code, shown, err = call(decode_main, *args, "--show", 2)
    assert code == shown_code == 0 and shown == plain
    heads = [line for line in err.splitlines() if line.startswith("sequence 0 step ")]
    assert [h.split(":")[0] for h in heads] == ["sequence 0 step 1", "sequence 0 step 2"]
    assert "\033[" not in err  # plain text: stderr is not a terminal


@pytest.mark.parametrize("bad", [("--temperature", 0.7), ("--show", 0), ("--bench",)])
def test_show_needs_a_greedy_decoding(bad):
    line = run_cli(decode_main, "--show", *bad) if bad[0] != "--show" else run_cli(decode_main, *bad)
    assert "--show" in line
