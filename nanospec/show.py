"""A decoding step drawn for a reader (decode.py --show, --show-html): the tree the step verified under its root, each
drafted token under its parent, the accepted path marked, the model's own next token after it (the bonus), and where
the drafts came from (a context drafter's matched suffix, in its own words: Drafter.drafts_from; ProPD: the nodes
pruned before verification).

It draws what the step already holds on the host (engine.generate's on_step gets a verify.Step): drawing reads nothing
back from the device and runs no forward, so a run with it emits what a run without it does.
"""
import html
import sys

MARK, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"  # the accepted path, the rejected drafts


def preorder(parents, node: int = 0, depth: int = 0):
    """(node, depth) of the drafted nodes under node, each before its children, children in index order."""
    for child in (i for i, p in enumerate(parents) if p == node):
        yield child, depth + 1
        yield from preorder(parents, child, depth + 1)


def draw(tree, path: list[int], tokens: list[int], text, colour: bool = False, pruned=()) -> list[str]:
    """The step's tree as lines: the root, then each drafted node as text(token id) under its parent, the accepted
    path's nodes marked `*` (bold green with colour, the rest dim), pruned ones `x`, then the bonus, tokens[-1]."""
    ids, accepted = tree.token_list(), set(path)
    children = {}
    for i, p in enumerate(tree.parents[1:], 1):
        children.setdefault(p, []).append(i)
    paint = lambda s, on: s if not colour else f"{MARK if on else DIM}{s}{RESET}"
    lines = [paint(text(ids[0]), True)]

    def under(node: int, indent: str) -> None:
        kids = children.get(node, [])
        for k, child in enumerate(kids):
            last, on = k == len(kids) - 1, child in accepted
            mark = " *" if on else " x (pruned)" if child in pruned else ""
            lines.append(f"{indent}{'`-' if last else '+-'} {paint(text(ids[child]) + mark, on)}")
            under(child, indent + ("   " if last else "|  "))
    under(0, "  ")
    lines.append(f"  => {paint(text(tokens[-1]), True)} (bonus: the model's own next token)")
    return lines


class Show:
    """An on_step for engine.generate that draws each sequence's first `steps` steps: on out (None: nowhere), a header
    line (the step's rows, the planner's budget and the price it used, the drafts accepted, where they came from), then
    the tree (draw),
    colour only on a terminal; and for page(), each step kept as HTML. drafter: the method decoding, for the names of
    its rows and its pruning layer."""

    def __init__(self, text, drafter, steps=float("inf"), out=sys.stderr, keep=False):
        self.text, self.drafter, self.steps, self.out, self.keep = text, drafter, steps, out, keep
        self.colour, self.seen, self.pages = out is not None and out.isatty(), {}, []  # seen: (number, steps so far)

    def __call__(self, dec, step) -> None:
        number, n = self.seen.get(dec, (len(self.seen), 0))
        self.seen[dec] = number, n + 1
        if n >= self.steps:
            return
        head = f"sequence {number} step {n + 1}: {self.header(dec, step)}"
        if self.out is not None:
            lines = draw(step.tree, step.path, step.tokens, self.text, self.colour, step.pruned)
            print("\n".join([head, *lines]), file=self.out, flush=True)
        if self.keep:
            self.pages.append(self.html(head, step))

    def header(self, dec, step) -> str:
        own, b = step.rows - len(step.tree), step.budget
        plan = "no planner" if b is None else f"budget {b}" + (" (an AR step)" if b == 0 else "")
        if b is not None:  # the price the plan used (planner.py)
            plan += f", {self.drafter.planner.priced(b)}"
        rows = f"{step.rows} rows" + (f" ({len(step.tree)} tree, {own} {self.drafter.own_rows})" if own else "")
        parts = [rows, plan, f"{len(step.path) - 1} of {len(step.tree) - 1} drafts accepted",
                 f"{len(step.tokens)} tokens emitted"]
        if step.tree.matched and len(step.tree) > 1:  # the context before the step: what the method's match read
            before = dec.prompt + dec.out[:len(dec.out) - len(step.tokens)]
            parts.append(f"drafts {self.drafter.drafts_from} " + " ".join(map(self.text, before[-step.tree.matched:])))
        if step.pruned:
            parts.append(f"{len(step.pruned)} pruned after layer {self.drafter.layer}")
        return ", ".join(parts)

    def html(self, head: str, step) -> str:
        """One step as a section: its header, then the tree as nested lists (li.accepted on the path, li.pruned)."""
        ids, esc = step.tree.token_list(), lambda i: html.escape(self.text(i))
        accepted, out, depth = set(step.path), [], 0
        for node, d in preorder(step.tree.parents):
            out += ["<ul>"] * (d - depth) + ["</li></ul>"] * (depth - d) + (["</li>"] if d <= depth else [])
            kind = "accepted" if node in accepted else "pruned" if node in step.pruned else "rejected"
            out.append(f'<li class="{kind}"><code>{esc(ids[node])}</code>')
            depth = d
        out += ["</li></ul>"] * depth
        return (f'<section class="step"><h2>{html.escape(head)}</h2><div class="tree"><code class="root">'
                f'{esc(ids[0])}</code>{"".join(out)}</div><p class="bonus">bonus: <code>{esc(step.tokens[-1])}</code>'
                "</p></section>")

    def page(self, title: str) -> str:
        """The kept steps as one self-contained HTML page (no script, no outside file)."""
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>
body {{ font-family: sans-serif; margin: 2em; }} h2 {{ font-size: 1em; font-weight: normal; }}
code {{ white-space: pre; }}
ul {{ list-style: none; margin: 0; padding-left: 1.5em; border-left: 1px solid #ccc; }}
li.accepted > code, code.root, .bonus code {{ background: #c8f0c8; font-weight: bold; }}
li.rejected > code {{ color: #888; }} li.pruned > code {{ color: #b00; text-decoration: line-through; }}
li.accepted > code::after {{ content: " *"; }}
</style></head><body><h1>{html.escape(title)}</h1>
<p>Each step: the root (the last emitted token), the drafted tokens under their parents, the accepted path in green,
the pruned nodes struck out, then the bonus token (the model's own next token).</p>
{chr(10).join(self.pages)}
</body></html>
"""
