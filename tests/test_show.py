"""decode.py --show and --show-html: each step drawn as the tree it verified, the accepted path marked as the tokens
it committed, where the drafts came from (a matched suffix, ProPD's pruned nodes), and a run's output as
without it; the HTML page in a real headless browser. decode.py --bench --plot: a valid PNG, or one line without the
plot extra."""
import html.parser
import importlib.util
import shutil
import struct
import subprocess

import pytest

from helpers import ARGS, METHODS, Adversary, call, decode_main, drafter, random_model, run_cli
from nanospec import engine
from nanospec.drafter import Drafter
from nanospec.engine import generate
from nanospec.methods import METHODS as REGISTRY
from nanospec.methods import propd
from nanospec.model import ModelArgs
from nanospec.show import Show, draw, preorder


@pytest.mark.parametrize("exact", [False, True])
def test_drawn_tree_is_the_verified_one(monkeypatch, exact):
    """On a planted drafter (random trees mixing AR's continuation with wrong branches), the tree on_step gets is the
    one the step laid out and verified, its drawing has a line per drafted node, and the marked nodes are the tokens
    the step committed, then the bonus: every step's, in order, make the output."""
    model = random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, intermediate_size=48))
    prompt, n = [3, 14, 15, 9, 2, 6], 24
    truth = generate(model, prompt, max_new_tokens=n, exact=exact, eos_id=-1).tokens
    verified, shown, real = [], [], engine.lay_out

    def lay_out(decs, drafter, trees, budget=None):
        verified.append(trees[0])
        return real(decs, drafter, trees, budget)
    monkeypatch.setattr(engine, "lay_out", lay_out)
    out = generate(model, prompt, Adversary(truth, 50, seed=1), max_new_tokens=n, exact=exact, eos_id=-1,
                   on_step=lambda dec, step: shown.append(step))
    assert out.tokens == truth and len(shown) == len(verified) == out.steps
    emitted = []
    for tree, (shown_tree, path, tokens, budget, rows, pruned, *_) in zip(verified, shown):
        assert shown_tree is tree and rows == len(tree) and budget is None and pruned == []
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert [tree.tokens[i] for i in path[1:]] == tokens[:-1] and len(tokens) == len(path)
        lines = draw(tree, path, tokens, str)
        drawn = [(line.index("-") // 3, line.split()[-2 if line.endswith(" *") else -1]) for line in lines[1:-1]]
        marked = [line.split()[-2] for line in lines[1:-1] if line.endswith(" *")]
        assert lines[0] == str(tree.tokens[0])
        assert drawn == [(d, str(tree.tokens[i])) for i, d in preorder(tree.parents)]
        assert marked == [str(t) for t in tokens[:-1]] and lines[-1].split()[1] == str(tokens[-1])
        emitted += tokens
    assert emitted[:n] == truth and sum(len(r.path) > 1 for r in shown) > 0  # some drafts were accepted


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


@pytest.mark.parametrize("exact", [False, True])
def test_pruned_nodes_are_the_ones_left_unverified(monkeypatch, exact):
    """ProPD with a planted pruning (every drafted node with an odd token goes): the nodes each step reports pruned are
    exactly those, none is on the accepted path, the output is AR's, and the drawing marks them."""
    model = random_model(ARGS, seed=3)
    prompt, n = [3, 14, 15, 9, 2, 6, 7, 1], 20
    truth = generate(model, prompt, max_new_tokens=n, exact=exact, eos_id=-1).tokens
    monkeypatch.setattr(propd, "pruned", lambda nodes, x, early, k: (nodes.tokens % 2 == 1) & (nodes.lay.parent >= 0))
    steps = []
    out = generate(model, prompt, drafter("propd", model), max_new_tokens=n, exact=exact, eos_id=-1,
                   on_step=lambda dec, step: steps.append(step))
    assert out.tokens == truth
    for s in steps:
        ids = s.tree.token_list()
        assert s.pruned == [i for i in range(1, len(ids)) if ids[i] % 2] and not set(s.pruned) & set(s.path)
        lines = draw(s.tree, s.path, s.tokens, str, pruned=s.pruned)
        assert sum(line.endswith("x (pruned)") for line in lines) == len(s.pruned)
    assert sum(map(len, (s.pruned for s in steps))) > 0


@pytest.mark.parametrize("name", [n for n in METHODS if REGISTRY[n].drafts_from != Drafter.drafts_from])
def test_a_context_drafter_names_the_suffix_it_matched(name):
    """A context drafter's steps carry how many of the context's last tokens it matched (Lookahead's trie, PLD's
    n-gram); a step that drafts names them in its header, in the method's words (Drafter.drafts_from), ending with
    the root, the last token emitted before the step."""
    model = random_model(ARGS, seed=3)
    prompt = [3, 14, 15, 9, 2, 6, 3, 14, 15, 9, 2, 6, 3, 14]
    shown = []
    show = Show(str, drafter(name, model), out=None)
    generate(model, prompt, show.drafter, max_new_tokens=24, eos_id=-1,
             on_step=lambda dec, step: shown.append((step, show.header(dec, step), list(dec.out))))
    matched = [(s, head, out) for s, head, out in shown if s.tree.matched and len(s.tree) > 1]
    assert matched
    for s, head, out in matched:
        before = (prompt + out)[:len(prompt) + len(out) - len(s.tokens)]
        assert head.endswith(f"drafts {show.drafter.drafts_from} " + " ".join(map(str, before[-s.tree.matched:])))
        assert before[-1] == s.tree.tokens[0]


class Page(html.parser.HTMLParser):
    """A page's steps: per section.step, its header and the classes of its tree's nodes."""

    def __init__(self):
        super().__init__()
        self.steps, self.in_h2 = [], False

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class")
        if tag == "section" and cls == "step":
            self.steps.append({"head": "", "nodes": []})
        self.in_h2 = tag == "h2" and bool(self.steps)
        if tag == "li" and self.steps:
            self.steps[-1]["nodes"].append(cls)

    def handle_data(self, data):
        if self.in_h2:
            self.steps[-1]["head"] += data

    def handle_endtag(self, tag):
        self.in_h2 = self.in_h2 and tag != "h2"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
@pytest.mark.parametrize("method", ["medusa", "propd"])
def test_html_page_in_a_headless_browser(tmp_path, method):
    """decode.py --show-html on the default model: Chromium loads the page with no console message, the DOM it built
    has one tree per step with as many accepted nodes as each step's header says, and a screenshot is a PNG."""
    page = tmp_path / "steps.html"
    code, out, err = call(decode_main, "--method", method, "--max-new-tokens", 16, "--show-html", page)
    steps = int(err.split(" steps, ")[0].rsplit(" ", 1)[-1])
    assert code == 0 and page.is_file() and "sequence 0 step" not in err  # no --show: nothing drawn on stderr
    run = lambda *a: subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *a],
                                    capture_output=True, text=True, timeout=120)
    dom = run("--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri())
    assert dom.returncode == 0 and "CONSOLE" not in dom.stderr, dom.stderr[-2000:]
    parsed = Page()
    parsed.feed(dom.stdout)
    assert len(parsed.steps) == steps > 1
    for s in parsed.steps:
        accepted = int(s["head"].split(" drafts accepted")[0].split(", ")[-1].split(" of ")[0])
        assert s["nodes"].count("accepted") == accepted
    assert any(s["nodes"].count("accepted") for s in parsed.steps)
    shot = tmp_path / "steps.png"
    assert run(f"--screenshot={shot}", "--window-size=900,700", page.as_uri()).returncode == 0
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the plot extra is not installed")
def test_bench_plot_is_a_png(tmp_path):
    """--bench --plot with two batch sizes writes a valid PNG (its signature and a non-empty IHDR)."""
    png = tmp_path / "bench.png"
    code, out, err = call(decode_main, "--bench", "--methods", "ar,medusa", "--max-new-tokens", 8, "--limit", 2,
                          "--batch", "1,2", "--plot", png)
    data = png.read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    assert code == 0 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and width > 0 and height > 0


def test_plot_without_the_extra_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert "pip install" in run_cli(decode_main, "--bench", "--plot", "x.png")
    assert "--bench" in run_cli(decode_main, "--plot", "x.png")
