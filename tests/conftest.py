import io
import os
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from hypothesis import HealthCheck, settings

from helpers import random_model
from nanospec.io.checkpoint import save
from nanospec.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]

settings.register_profile("default", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=400,
                          suppress_health_check=[HealthCheck.too_slow])
# CUDA: fewer examples per property (each random model captures its own CUDA graphs), the same properties
settings.register_profile("cuda", deadline=None, max_examples=8,
                          suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("NANOSPEC_TEST_DEVICE", "cpu"),
                     help="device for model tests: cpu or cuda (or set NANOSPEC_TEST_DEVICE)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")
    on_cuda = config.getoption("--device") == "cuda"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cuda" if on_cuda else "default"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # xdist: share the cores instead of every worker taking all of them
        torch.set_num_threads(max(1, cores() // workers))


def cores() -> int:
    """The cores this process may run on (a container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker per core this process may use. Most tests run tiny models,
    bound by Python rather than arithmetic, so a worker per core of one thread each beats one process of all."""
    return cores()


def pytest_collection_modifyitems(config, items):
    """`--device cuda` runs the tests whose result depends on the device (those that take the
    `device` fixture or are marked `cuda`); the rest run the same on any machine, in the CPU suite."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
    if config.getoption("--device") != "cuda":
        return
    keep = [i for i in items if "device" in i.fixturenames or i.get_closest_marker("cuda")]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_report_header(config):
    if config.getoption("--device") == "cuda":
        return "--device cuda: device-independent tests are deselected (the CPU suite runs them)"


@pytest.fixture(scope="session")
def weights(tmp_path_factory):
    """A tiny random model with a real sentencepiece tokenizer, in HF format."""
    d = tmp_path_factory.mktemp("tiny")
    text = (ROOT / "nanospec" / "model.py").read_text().splitlines()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, pad_id=3, minloglevel=2)
    (d / "tok.model").write_bytes(buf.getvalue())
    model = random_model(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=400, intermediate_size=48))
    save(model, d, tokenizer_model=d / "tok.model")
    return d


@pytest.fixture(scope="session")
def device(request):
    dev = request.config.getoption("--device")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but no CUDA device is available")
    return dev
