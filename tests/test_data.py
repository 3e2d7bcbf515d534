"""The stdlib corpus: a deterministic, disjoint file split and held-out evaluation prompts."""
import json
import platform
from pathlib import Path

import pytest

from nanospec.training import data

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "weights" / "pylm" / "prompts.jsonl"


def test_split_is_deterministic_disjoint_and_about_5_percent():
    files = data.corpus_files()
    assert files == sorted(set(files)) and len(files) > 500
    assert not any("site-packages" in f for f in files)
    first = {f: data.split_of(f) for f in files}
    assert first == {f: data.split_of(f) for f in reversed(files)}  # no state, no order dependence
    val = {f for f, s in first.items() if s == "val"}
    train = {f for f, s in first.items() if s == "train"}
    assert val and train and not val & train and val | train == set(files)
    assert 0.02 < len(val) / len(files) < 0.09
    # the split depends on the relative path only: a fixed example pins the hash function
    assert data.split_of("json/decoder.py") == ("val" if int.from_bytes(
        __import__("hashlib").sha256(b"json/decoder.py").digest()[:8], "big") % 100 < 5 else "train")


def test_documents_respect_the_split():
    docs = data.documents("val", max_files=5)
    assert len(docs) == 5 and all(data.split_of(rel) == "val" and text for rel, text in docs)


def test_function_prompts_cut_after_the_docstring():
    src = ('class A:\n    def f(self, x):\n        """Add one.\n\n        More.\n        """\n'
           '        y = x\n        y += 1\n        return y\n\n'
           'def short():\n    "doc"\n    return 1\n\ndef nodoc(a):\n    a += 1\n    a += 2\n    return a\n')
    assert data.function_prompts(src) == ['def f(self, x):\n    """Add one.\n\n    More.\n    """\n']
    assert data.function_prompts("def broken(:\n") == []


def test_shipped_prompts_come_from_held_out_files():
    made_with = json.loads((PROMPTS.parent / "training.json").read_text())["python"]
    if made_with.rsplit(".", 1)[0] != platform.python_version().rsplit(".", 1)[0]:
        pytest.skip(f"the prompts come from Python {made_with}'s stdlib; this is {platform.python_version()}")
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    assert len(prompts) >= 32
    val_text = "\n".join(text for _, text in data.documents("val"))
    for p in prompts:
        assert p.startswith(("def ", "async def ")) and p.endswith("\n")
        assert p.splitlines()[0].strip() in val_text
