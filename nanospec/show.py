"""A decoding step drawn as text (decode.py --show): the tree the step verified under its root, each drafted token
indented under its parent, the accepted path marked, and the model's own next token after it (the bonus).

It draws what the step already holds on the host (engine.generate's on_step): drawing reads nothing back from the
device and runs no forward, so a run with it emits what a run without it does.
"""
import sys

MARK, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"  # the accepted path, the rejected drafts


def draw(tree, path: list[int], tokens: list[int], text, colour: bool = False) -> list[str]:
    """The step's tree as lines: the root, then each drafted node as text(token id) under its parent, the accepted
    path's nodes marked `*` (bold green with colour, the rest dim), then the bonus token, tokens[-1]."""
    ids, accepted = tree.token_list(), set(path)
    children = {}
    for i, p in enumerate(tree.parents[1:], 1):
        children.setdefault(p, []).append(i)
    paint = lambda s, on: s if not colour else f"{MARK if on else DIM}{s}{RESET}"
    lines = [paint(text(ids[0]), True)]

    def under(node: int, indent: str) -> None:
        kids = children.get(node, [])
        for k, child in enumerate(kids):
            last = k == len(kids) - 1
            on = child in accepted
            lines.append(f"{indent}{'`-' if last else '+-'} {paint(text(ids[child]) + (' *' if on else ''), on)}")
            under(child, indent + ("   " if last else "|  "))
    under(0, "  ")
    lines.append(f"  => {paint(text(tokens[-1]), True)} (bonus: the model's own next token)")
    return lines


class Show:
    """An on_step for engine.generate that prints each sequence's first `steps` steps to out: a header line (the
    step's rows, the planner's budget, the drafts accepted), then the tree (draw). Colour only on a terminal."""

    def __init__(self, text, steps=float("inf"), out=None):
        self.text, self.steps, self.out = text, steps, out or sys.stderr
        self.colour, self.seen = self.out.isatty(), {}  # per sequence: (its number, steps so far)

    def __call__(self, dec, tree, path, tokens, budget, rows) -> None:
        number, n = self.seen.get(dec, (len(self.seen), 0))
        self.seen[dec] = number, n + 1
        if n >= self.steps:
            return
        plan = "no planner" if budget is None else f"budget {budget}" + (" (an AR step)" if budget == 0 else "")
        head = (f"sequence {number} step {n + 1}: {rows} rows, {plan}, {len(path) - 1} of {len(tree) - 1} drafts "
                f"accepted, {len(tokens)} tokens emitted")
        print("\n".join([head, *draw(tree, path, tokens, self.text, self.colour)]), file=self.out, flush=True)
