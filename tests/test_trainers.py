"""The method trainers end to end on a tiny base model: train.py writes drafter files that load
and decode exactly. (Training quality is the business of each method's own tests.)"""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train
from helpers import call, check_exact, random_model
from nanospec.io.checkpoint import load, save
from nanospec.methods import analysis, bita, hidden_transfer, load_drafter, medusa, model_dir, propd, sdsat
from nanospec.model import ModelArgs
from nanospec.tuning.second_device import SHOWN, second_device

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "weights" / "pylm" / "tokenizer.model"
SMALL = {  # each trainer's options, cut to seconds
    "medusa": ["--epochs", "0.05", "--batch-size", "64", "--tree-size", "4", "--token-input", "--shared-head",
               "--draft-vocab", "300", "--early-layers", "1", "--early-steps", "3", "--early-batch", "32",
               "--early-rank", "4"],
    "propd": ["--early-layers", "1", "--early-steps", "3", "--early-batch", "32", "--early-rank", "4"],
    "bita": ["--steps", "3", "--batch-size", "2", "--groups", "2", "--prompts", "2"],
    "hidden_transfer": ["--steps", "3", "--batch-size", "2", "--layers", "1"],
    "sdsat": ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--rank", "2"],
}


def train_all(tmp_path, monkeypatch, device, *more) -> list[set[str]]:
    """train.py for every drafter on a tiny base model written to tmp_path; the devices of each module a trainer
    writes: medusa's heads and its early head, propd's, bita's, the maps, sdsat's update."""
    from nanospec.io import checkpoint
    model = random_model(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=8192, intermediate_size=24), 0)
    save(model, tmp_path, tokenizer_model=TOKENIZER)
    trained_on = []
    for m in (medusa, propd, bita, hidden_transfer, sdsat):
        monkeypatch.setattr(m, "save_drafter", lambda path, module, meta: trained_on.append(
            {p.device.type for p in module.parameters()}) or checkpoint.save_drafter(path, module, meta))
    for method, opts in SMALL.items():
        code, out, err = call(train.main, "--method", method, "--out", tmp_path, "--distill-prompts", 6,
                              "--new-tokens", 8, "--device", device, *opts, *more)
        assert code == 0, err[-2000:]
    return trained_on


def test_trainers_write_loadable_drafters(tmp_path, device, monkeypatch):
    """On the device under test (`pytest --device cuda`: train.py --device cuda, the base model and every trained
    module on it); the drafters decode on the CPU."""
    assert train_all(tmp_path, monkeypatch, device) == [{device}] * 6
    code, out, err = call(analysis.main, "heldout", "--weights", tmp_path, "--distill-prompts", 6, "--new-tokens", 8)
    rows = [line.split(" | ")[1] for line in out.splitlines() if line.startswith(f"| {tmp_path} |")]
    assert code == 0 and rows == ["medusa", "hidden_transfer", "bita", "sdsat"], err[-2000:]
    base = load(tmp_path)
    for spec in ("medusa", "propd:layer=1", "bita", "hidden_transfer", "sdsat:k=3"):
        check_exact(base, [1, 400, 401, 402], load_drafter(spec, base, tmp_path), 12)
    code, out, err = call(analysis.main, "hidden_transfer", "--weights", tmp_path, "--distill-prompts", 6,
                          "--new-tokens", 8, "--early-steps", 2, "--early-rank", 4)
    assert code == 0 and "Figure 3" in out and "Figure 4" in out, err[-2000:]
    # the paper's SDSAT fine-tunes the base into a model directory of its own, decoded against its own AR
    code, out, err = call(train.main, "--method", "sdsat_full", "--out", tmp_path, "--steps", 2, "--batch-size", 2,
                          "--seq-len", 32, "--max-files", 2, "--eval-windows", 2, "--distill-prompts", 6,
                          "--new-tokens", 8, "--device", device)
    assert code == 0, err[-2000:]
    tuned = load(model_dir(["sdsat_full"], tmp_path))
    check_exact(tuned, [1, 400, 401, 402], load_drafter("sdsat_full:k=3", tuned, tmp_path), 12)


def test_trainers_train_on_the_device_they_are_given(tmp_path, monkeypatch):
    """train.py --device cuda on the second-device stand-in (second_device.py), with .ci/gpu-train's teacher-forced
    data and time limit: every op keeps to one device, as on a GPU, and every module a trainer writes was there."""
    with second_device():
        trained_on = train_all(tmp_path, monkeypatch, "cuda", "--forced", 600, "--time-limit", 60,
                               "--cache", tmp_path / "ckpt")
        code, out, err = call(train.main, "--method", "sdsat_full", "--out", tmp_path, "--steps", 2, "--batch-size", 2,
                              "--seq-len", 32, "--max-files", 2, "--eval-windows", 2, "--distill-prompts", 6,
                              "--new-tokens", 8, "--device", "cuda")
    assert trained_on == [{SHOWN.type}] * 6 and code == 0, err[-2000:]


def test_the_stand_in_catches_a_trainer_that_leaves_tensors_on_the_host(tmp_path, monkeypatch):
    """Planted: Hidden Transfer's batches made on the host (an op mixes devices), then the base model loaded there
    whatever --device says (then every module stays on the host)."""
    from nanospec.training import loop
    pack = hidden_transfer.pack
    with second_device():
        monkeypatch.setattr(hidden_transfer, "pack", lambda *args, **kwargs: pack(*args[:4]))
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            train_all(tmp_path, monkeypatch, "cuda")
        monkeypatch.setattr(hidden_transfer, "pack", pack)
        load = loop.load
        monkeypatch.setattr(loop, "load", lambda path, dtype=torch.float32, device="cpu": load(path, dtype))
        assert train_all(tmp_path, monkeypatch, "cuda") == [{"cpu"}] * 6


@pytest.mark.parametrize("method, opts", [("hidden_transfer", ["--layers", 1]),
                                          ("sdsat", ["--seq-len", 32, "--rank", 2]),
                                          ("sdsat_full", ["--seq-len", 32, "--max-files", 2, "--eval-windows", 2])])
def test_an_interrupted_drafter_trainer_resumes_exactly(tmp_path, monkeypatch, method, opts):
    """Every drafter trainer checkpoints: a run stopped after a checkpoint and resumed writes the same
    weights as an uninterrupted one, and its metadata counts the time spent before the stop. (sdsat_full
    writes a model directory of its own.)"""
    from nanospec.training import loop as training
    model = random_model(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=8192, intermediate_size=24), 0)
    save(model, tmp_path / "m", tokenizer_model=TOKENIZER)
    full = tmp_path / "m-sdsat"
    written = full / "model.safetensors" if method == "sdsat_full" else tmp_path / "m" / f"{method}.safetensors"
    opts = ["--method", method, "--out", tmp_path / "m", "--distill-prompts", 6, "--new-tokens", 8,
            "--steps", 6, "--batch-size", 2, *opts, "--save-every", 2, "--cache", tmp_path / "ckpt"]
    assert call(train.main, *opts)[0] == 0
    whole = load_file(written)
    real = training.Progress.step

    def crash(self, step, *a, **k):
        if step == 3:
            raise KeyboardInterrupt
        real(self, step, *a, **k)
    clock = iter(range(0, 10**6, 100))  # the stopped run's clock: 100 s a reading
    monkeypatch.setattr(training.Progress, "step", crash)
    monkeypatch.setattr(training, "time", SimpleNamespace(time=lambda: next(clock)))
    try:
        call(train.main, *opts)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    spent = torch.load(next((tmp_path / "ckpt").glob(f"{method}-*.pt")), weights_only=False)["seconds"]
    monkeypatch.setattr(training, "time", SimpleNamespace(time=lambda: 0.0))  # the resumed run takes no time
    code, out, err = call(train.main, *opts, "--resume")
    assert code == 0 and "resumed from" in out and "at step 2 of " in out, err
    resumed = load_file(written)
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    if method == "sdsat_full":
        seconds = json.loads((full / "sdsat.json").read_text())["wall_time_s"]
    else:
        with safe_open(written, framework="pt") as f:
            seconds = json.loads(f.metadata()["trained"])["seconds"]
    assert spent > 0 and seconds == round(spent)
    code, out, err = call(train.main, *opts, "--steps", 2, "--resume")  # nothing left to train
    assert code == 0 and "nothing is left to train" in out, err


def test_a_resume_with_other_options_is_refused_in_one_line(tmp_path):
    from nanospec import NanospecError
    from nanospec.training.loop import Checkpoint
    args = SimpleNamespace(cache=tmp_path, resume=False, save_every=1)
    a = torch.nn.Linear(4, 4)
    ckpt = Checkpoint(args, "x", a, torch.optim.AdamW(a.parameters()))
    ckpt.progress(2, every=1)
    steps = ckpt.steps()
    next(steps), next(steps)  # step 0 ran: its checkpoint, of a 4 x 4 module
    b = torch.nn.Linear(4, 8)
    with pytest.raises(NanospecError, match="holds another module than this run builds"):
        Checkpoint(SimpleNamespace(cache=tmp_path, resume=True), "x", b, torch.optim.AdamW(b.parameters()))


def test_a_time_limit_cuts_the_schedule_to_fit(tmp_path, monkeypatch):
    """--time-limit: the first steps are timed and the run's length cut to what fits, so its schedule ends at
    its floor within the limit; a run that slows down stops at the limit; both are checkpointed where they
    stopped, and a resume without the limit goes on."""
    from nanospec.training import loop as training
    now = [0.0]
    monkeypatch.setattr(training, "time", SimpleNamespace(time=lambda: now[0]))

    def run(limit, cost, steps=1000, resume=False):
        args = SimpleNamespace(cache=tmp_path, resume=resume, save_every=None, time_limit=limit)
        m = torch.nn.Linear(2, 2)
        ckpt = training.Checkpoint(args, "x", m, torch.optim.AdamW(m.parameters()))
        ckpt.progress(steps, every=10**6)
        t0, lrs = now[0], []
        for step in ckpt.steps():
            lrs.append(training.cosine_lr(step, ckpt.total, 1.0, warmup=5))
            now[0] += cost(step)
        saved = torch.load(tmp_path / "x.pt", weights_only=False)
        return ckpt.total, lrs, now[0] - t0, (saved["step"], saved["steps"])

    total, lrs, took, saved = run(100, lambda step: 2.0)  # 10 steps in 20 s after the first: 39 more fit
    assert total == 50 and len(lrs) == 50 and took == 100 and saved == (50, 50)
    assert lrs[-1] < 0.102 and min(lrs) == lrs[-1]  # the schedule reached its floor
    total, lrs, took, saved = run(100, lambda step: 2.0 if step < 10 else 4.0)  # slower after the timing
    assert total == 30 and len(lrs) == 30 and took == 100 and saved == (30, 30)
    total, lrs, took, saved = run(None, lambda step: 2.0, steps=50, resume=True)
    assert total == 50 and len(lrs) == 20 and saved == (50, 50)
    total, lrs, took, saved = run(100, lambda step: 1.0, steps=40)  # all of it fits: nothing is cut
    assert total == 40 and len(lrs) == 40 and took == 40
    total, lrs, took, saved = run(100, lambda step: 50.0 if step == 0 else 1.0)  # a first step that warms up
    assert total == 51 and took == 100  # is not what the others cost


def test_a_trainer_writes_what_fits_its_time_limit(tmp_path, monkeypatch):
    """train.py --time-limit end to end: the drafter is written with the steps that fit, and says so."""
    from nanospec.training import loop as training
    model = random_model(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=8192, intermediate_size=24), 0)
    save(model, tmp_path, tokenizer_model=TOKENIZER)
    clock = iter(range(0, 10**9))  # a second a reading: a step takes a few
    monkeypatch.setattr(training, "time", SimpleNamespace(time=lambda: next(clock)))
    code, out, err = call(train.main, "--method", "sdsat", "--out", tmp_path, "--distill-prompts", 6,
                          "--new-tokens", 8, "--steps", 200, "--batch-size", 2, "--seq-len", 32, "--rank", 2,
                          "--time-limit", 30, "--cache", tmp_path / "ckpt")
    assert code == 0 and "--time-limit 30s:" in out and "steps fit, not 200" in out, err
    with safe_open(tmp_path / "sdsat.safetensors", framework="pt") as f:
        steps = json.loads(f.metadata()["trained"])["steps"]
    assert 10 < steps < 40 and f"step {steps}/{steps}" in out
    code, _, err = call(train.main, "--method", "sdsat", "--out", tmp_path, "--time-limit", 0)
    assert code == 2 and "--time-limit must be a positive" in err and len(err.strip().splitlines()) == 1


def test_the_held_out_set_leaves_out_what_trained_another_run(tmp_path, monkeypatch):
    """analysis.held_out: a run's held-out pairs (every 10th), less those whose prompt trained a run on fewer
    prompts, so two runs' drafters are compared on sequences neither saw. (Made-up functions, longest first, so
    a run's length order differs from the other's: the stdlib's would take a scan of the stdlib.)"""
    from nanospec.io.tokenizer import load_tokenizer
    from nanospec.training import data
    from nanospec.training.data import distill, distill_prompts
    monkeypatch.setattr(data, "CACHE", tmp_path)
    monkeypatch.setattr(data, "train_functions", lambda n: [(" ".join(["a"] * (99 - i)), None) for i in range(n)])
    model = random_model(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=8192, intermediate_size=24), 0)
    tok = load_tokenizer(TOKENIZER.parent)
    every = distill(model, tok, 60, 4)[::10]
    held = analysis.held_out(model, tok, 60, 4, also=[25])
    trained = {tuple(p) for i, p in enumerate(distill_prompts(tok, 25)) if i % 10}
    assert held == [d for d in every if tuple(d[0]) not in trained] and 0 < len(held) < len(every)
    assert analysis.held_out(model, tok, 60, 4) == every
