"""Drafters attach by the base model's fingerprint: from any source of the same weights (a copy of
the directory, a GGUF) and in any dtype (the fingerprint names the stored weights, not their cast)."""
import shutil
from pathlib import Path

import pytest
import torch

from gguf_files import write_llama_cpp_gguf
from helpers import PYLM as W
from helpers import SHIPPED
from nanospec import NanospecError
from nanospec.io import sources
from nanospec.io.checkpoint import load
from nanospec.io.files import fingerprint
from nanospec.methods import drafters_for, load_drafter, split_specs

SMOL = Path(__file__).resolve().parents[1] / "weights" / "smollm2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shipped_drafters_load_in_every_dtype(dtype):
    model = load(W, dtype)
    assert fingerprint(model) == fingerprint(load(W))
    for spec in SHIPPED:
        load_drafter(spec, model, W)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_drafters_load_in_every_dtype(dtype):
    base = sources.converted("smollm2")
    if not (base / "config.json").is_file():
        pytest.skip("SmolLM2 is not fetched: python -m nanospec.io.fetch smollm2")
    model = load(base, dtype)
    assert drafters_for(model, base) == SMOL
    for name in split_specs("all"):  # every method that decodes the base model
        load_drafter(name, model, SMOL)


def test_drafters_are_found_for_a_copy_and_a_gguf(tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.model"):
        shutil.copy(W / f, copy / f)
    assert drafters_for(load(copy), copy) == W
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    converted = sources.resolve(write_llama_cpp_gguf(load(W), tmp_path / "pylm.gguf", "F32"))
    model = load(converted, torch.bfloat16)
    assert drafters_for(model, converted) == W
    load_drafter("medusa", model, drafters_for(model, converted))


def test_another_model_finds_none(weights):
    """A model no shipped drafter was trained for: its own directory, where the loader says what is missing."""
    model = load(weights)
    assert drafters_for(model, weights) == weights
    with pytest.raises(NanospecError, match="no medusa.safetensors"):
        load_drafter("medusa", model, drafters_for(model, weights))
    with pytest.raises(NanospecError, match="no such directory"):
        drafters_for(model, weights, given=weights / "nope")
