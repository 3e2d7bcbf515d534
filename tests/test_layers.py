"""The package's imports point down: every import of a nanospec module by another, lazy ones inside
functions included, read from the source; no cycle, and no module imports from a higher layer."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nanospec"

# Lowest first. A module may import its own layer's modules (without a cycle) and lower layers'.
LAYERS = [
    {"nanospec", "io", "oracle", "training", "tuning",                          # leaves: nothing of the package
     "io.files", "io.tokenizer_json", "io.gguf_tokenizer", "tuning.second_device", "show", "plot"},
    {"devices"},                                                                # a device's facts, as values
    {"rope", "fused", "exact", "model", "forward", "cache", "tree", "planner",  # the model and its parts
     "compiled", "tuning.products", "programs"},
    {"io.checkpoint", "io.tokenizer", "io.chat", "io.gguf_export", "io.convert",  # weights and text in and out
     "io.sources", "io.fetch", "oracle.calibration", "oracle.trace", "oracle.verdict"},
    {"drafter", "verify", "sizes", "engine"},                                   # the contract and the loop
    {"costs", "tuning.measured", "tuning.probing", "tuning.counts", "training.data",
     "training.loop", "training.pretrain", "training.forced",
     "methods"},                                    # drafters and their trainers (METHOD: each methods/*.py file)
    {"bench", "oracle.peers", "methods.analysis", "oracle.engines", "oracle.engines.hf", "oracle.engines.llamacpp",
     "oracle.engines.openai", "oracle.compare", "oracle.forced", "oracle.noise", "oracle.whole", "oracle.plants",
     "oracle.floors"},                                                         # command lines and the oracle
]
METHOD = next(i for i, layer in enumerate(LAYERS) if "methods" in layer)  # a method's file, whatever its name (but
# methods/analysis.py, a command line)
LEVEL = {m: i for i, layer in enumerate(LAYERS) for m in layer} | {
    f"methods.{p.stem}": METHOD for p in (PKG / "methods").glob("*.py") if p.stem not in ("__init__", "analysis")}


def name_of(path: Path) -> str:
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "nanospec"


def imports(path: Path) -> set[str]:
    """The package modules `path` imports, anywhere in its body."""
    me = name_of(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    pkg = [] if pkg == ["nanospec"] else pkg
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - node.level + 1] + (node.module.split(".") if node.module else [])
            cands = [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanospec"):
            base = node.module.split(".")[1:]
            cands = [".".join(base) or "nanospec"] + [".".join(base + [a.name]) for a in node.names]
        elif isinstance(node, ast.Import):
            cands = [a.name.removeprefix("nanospec.") for a in node.names if a.name.startswith("nanospec")]
        else:
            continue
        found |= {c or "nanospec" for c in cands if c in LEVEL and c != me}
    return found


def graph() -> dict[str, set[str]]:
    return {name_of(p): imports(p) for p in PKG.rglob("*.py")}


def test_every_module_has_a_layer():
    assert set(graph()) == set(LEVEL)


def test_imports_point_down():
    up = [f"{m} -> {n}" for m, deps in graph().items() for n in deps if LEVEL[n] > LEVEL[m]]
    assert not up, "imports from a higher layer: " + ", ".join(sorted(up))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part that has one (depth-first search)."""
    found, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"
    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    g = graph()
    g["model"] = g["model"] | {"io.checkpoint"}  # checkpoint imports model: a cycle, and an import upward
    assert cycles(g) and LEVEL["io.checkpoint"] > LEVEL["model"]
    assert "cache" in imports(PKG / "tree.py")  # the parser sees the real imports
