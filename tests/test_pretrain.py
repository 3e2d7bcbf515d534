"""train.py --method base on a tiny config: loss goes down, resume is exact, the bigram baseline is sane."""
import json
import math
from pathlib import Path

import numpy as np
import torch

import train
from helpers import call
from nanospec.io.checkpoint import load
from nanospec.training import loop, pretrain

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--method", "base", "--tokenizer", str(ROOT / "weights" / "pylm" / "tokenizer.model"),
        "--max-files", "6", "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
        "--intermediate-size", "48", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--warmup", "4"]


def test_tiny_training_run_reduces_loss(tmp_path):
    code, out, err = call(train.main, *TINY, "--steps", 40, "--eval-every", 10, "--out", tmp_path / "m",
                          "--cache", tmp_path / "c")
    assert code == 0, err
    assert "step 40/40 | loss" in out and "eta" in out and "held-out" in out
    report = json.loads((tmp_path / "m" / "training.json").read_text())
    hist = report["history"]
    assert [h["step"] for h in hist] == [10, 20, 30, 40]
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] < math.log(report["parameters"])  # loose sanity
    assert report["val_loss_nats"] < math.log(8192) - 1 and report["tokens_seen"] == 40 * 4 * 32
    model = load(tmp_path / "m")  # HF directory with tokenizer, loadable by our loader
    assert (tmp_path / "m" / "tokenizer.model").is_file() and model.args.tie_embeddings


def test_resume_after_interruption_is_exact(tmp_path, monkeypatch):
    """It checkpoints as the drafter trainers do (loop.Checkpoint): a resumed run writes the uninterrupted run's
    weights and held-out history, a finished run resumed with more steps goes on, another config is refused."""
    def run(out, steps_before_crash=None, resume=False, steps=10):
        args = train.parse_args([*TINY, "--steps", str(steps), "--save-every", "4", "--eval-every", "4",
                                 "--out", str(out), "--cache", str(tmp_path / "c")] + (["--resume"] if resume else []))
        if steps_before_crash is not None:
            real = loop.Progress.step

            def crash(self, step, *a, **k):
                if step == steps_before_crash:
                    raise KeyboardInterrupt
                real(self, step, *a, **k)
            monkeypatch.setattr(loop.Progress, "step", crash)
        try:
            pretrain.train_base(args)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
    history = lambda out: [h["val_loss"] for h in json.loads((out / "training.json").read_text())["history"]]

    run(tmp_path / "a")
    run(tmp_path / "b", steps_before_crash=6)  # dies after the step-4 checkpoint
    assert not (tmp_path / "b" / "model.safetensors").exists()
    run(tmp_path / "b", resume=True)
    a, b = load(tmp_path / "a").state_dict(), load(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(history(tmp_path / "a")) == 3 and history(tmp_path / "b") == history(tmp_path / "a")  # 4, 8, 10
    run(tmp_path / "b", resume=True, steps=14)  # the finished run's last step (10) was saved: it goes on from there
    assert len(history(tmp_path / "b")) == 5
    wider = TINY[:TINY.index("--dim")] + ["--dim", "48"] + TINY[TINY.index("--dim") + 2:]  # another model
    code, _, err = call(train.main, *wider, "--steps", 20, "--resume", "--out", tmp_path / "b",
                        "--cache", tmp_path / "c")
    assert code == 2 and "another model config" in err and len(err.strip().splitlines()) == 1


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    code, _, err = call(train.main, *TINY, "--resume", "--out", tmp_path / "m", "--cache", tmp_path / "none")
    assert code == 2 and err.startswith("error: --resume: no checkpoint") and len(err.strip().splitlines()) == 1


def test_bigram_baseline():
    V = 16
    periodic = np.tile(np.arange(V, dtype=np.uint16), 200)
    wins = torch.from_numpy(periodic[:33 * 4].astype(np.int64)).view(4, 33)
    assert pretrain.bigram_loss(periodic, wins, V) < 0.05
    rand = np.random.default_rng(0).integers(0, V, 200_000).astype(np.uint16)
    wins = torch.from_numpy(rand[:33 * 64].astype(np.int64)).view(64, 33)
    assert abs(pretrain.bigram_loss(rand, wins, V) - math.log(V)) < 0.05


def test_unknown_training_method_is_one_line():
    code, _, err = call(train.main, "--method", "nope")
    assert code == 2 and err.strip() == ("error: unknown method 'nope'; choose from: tokenizer, base, medusa, propd, "
                                         "bita, hidden_transfer, sdsat, sdsat_full")
    code, _, err = call(train.main, "--method", "medusa", "--heads", "three")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "invalid int value" in err
