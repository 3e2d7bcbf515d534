"""`python -m nanospec.io.convert DIR OUT.gguf`: an HF directory as an F32 GGUF. Converting that file
back gives the same tensors, config and tokenizer (so llama.cpp reads the weights nanospec runs);
a sentencepiece directory goes in as llama.cpp's `llama` tokenizer; --layers keeps a prefix."""
import json

import pytest
import torch

gguf = pytest.importorskip("gguf")  # an optional dependency

from gguf_files import write_gguf
from helpers import call, run_cli
from nanospec.io import convert
from nanospec.io.checkpoint import load, load_tensors
from nanospec.io.gguf_export import export
from nanospec.io.sources import as_gguf
from nanospec.io.tokenizer import load_tokenizer


@pytest.mark.parametrize("qtype, tie", [("Q4_1", True), ("F32", False)])
def test_round_trip(tmp_path, qtype, tie):
    src = convert.convert(write_gguf(tmp_path / "a.gguf", qtype, tie=tie), tmp_path / "a")
    code, out, err = call(convert.main, src, tmp_path / "b.gguf")
    assert code == 0, err
    back = convert.convert(tmp_path / "b.gguf", tmp_path / "b")
    x, y = load_tensors(src), load_tensors(back)
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)  # bitwise: F32 keeps every value
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert json.loads((src / f).read_text()) == json.loads((back / f).read_text()), f
    reader = gguf.GGUFReader(tmp_path / "b.gguf")
    assert {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors} == {"F32"}
    assert ("output.weight" in {t.name for t in reader.tensors}) == (not tie)


def test_sentencepiece_directory_and_layers(weights, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    out = export(weights, tmp_path / "m.gguf", layers=1)
    reader = gguf.GGUFReader(out)
    field = lambda k: reader.fields[k].contents()
    assert field("tokenizer.ggml.model") == "llama" and field("llama.block_count") == 1
    dummy_prefix = load_tokenizer(weights).sp.encode("a", out_type=str)[0].startswith("\u2581")  # as trained
    assert field("tokenizer.ggml.add_space_prefix") is dummy_prefix and field("tokenizer.ggml.add_bos_token") is True
    assert len(field("tokenizer.ggml.tokens")) == len(field("tokenizer.ggml.scores")) == 400
    assert {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")} == {"0"}
    # as_gguf: a directory is exported once into the cache, keyed by its files; a .gguf is itself
    first = as_gguf(weights, weights)
    assert first.is_file() and as_gguf(weights, weights) == first and as_gguf(out, None) == out
    assert load(weights).args.n_layers == 2  # the source is untouched


def test_export_errors(weights, tmp_path):
    assert "must be a .gguf" in run_cli(convert.main, weights, tmp_path / "x.bin")
    assert "the model has 2 layers" in run_cli(convert.main, weights, tmp_path / "x.gguf", "--layers", "3")
    assert "its directory does not exist" in run_cli(convert.main, weights, tmp_path / "no" / "x.gguf")
    assert "--layers applies to DIR" in run_cli(convert.main, tmp_path / "a.gguf", tmp_path / "d", "--layers", "1")
    assert not list(tmp_path.glob("*.gguf"))
