"""The second-device stand-in (second_device.py) refuses what CUDA refuses, allows what CUDA allows, and computes what
the host computes."""
import json

import pytest
import torch

from helpers import ARGS, METHODS, call, decode_main, drafter, feed, random_model
from nanospec.cache import KVCache
from nanospec.engine import generate
from nanospec.tuning.second_device import SHOWN, OnDevice, second_device

PROMPTS = [[3, 9, 4, 1, 7, 12, 5], [5, 2, 8, 8, 1, 12, 30, 4, 11, 2]]


def test_the_stand_in_keeps_cudas_rules(tmp_path):
    available = torch.cuda.is_available
    with second_device():
        x = torch.arange(4.0).to("cuda")
        assert x.device == SHOWN and torch.zeros(2, device="cuda").device == SHOWN and x.cuda() is x
        assert torch.nn.Linear(2, 2).to(device="cuda", dtype=torch.bfloat16).weight.device == SHOWN
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)  # a host tensor in a device op
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(4)[torch.tensor([1, 2], device="cuda")]  # device indices into a host tensor
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert (x * torch.tensor(2.0)).device == SHOWN  # a 0-dim host tensor is a scalar
        assert x[torch.tensor([1, 3])].tolist() == x[[1, 3]].tolist() == [1.0, 3.0]  # host indices, device data
        back = x.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu" and back.tolist() == [0.0, 1.0, 2.0, 3.0]
        y = torch.zeros(4)
        y.copy_(x)  # copies cross
        assert y.tolist() == back.tolist() and type(x.to(torch.bfloat16)) is OnDevice
        torch.save({"x": x}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt")["x"], back) and torch.cuda.is_available is available


def test_the_stand_in_trains_as_the_host_does():
    """A module moved there takes the same steps, bit for bit, as on the host."""
    def steps(device):
        torch.manual_seed(0)
        lin, x = torch.nn.Linear(8, 4).to(device), torch.randn(16, 8).to(device)
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        for _ in range(3):
            lin(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {p.device.type for p in lin.parameters()}, lin.weight.detach().cpu()
    host, on_host = steps("cpu")
    with second_device():
        there, on_device = steps("cuda")
    assert host == {"cpu"} and there == {SHOWN.type} and torch.equal(on_host, on_device)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_decodes_on_the_second_device(name):
    """`--device cuda`'s placement, seen on the CPU: every method decodes a batch with its drafts accepted, in exact
    and fast mode, and no op mixes devices. (Its bits are the GPU's check: exact mode's CPU layout is the host's.)"""
    N = 8
    with second_device():
        model = random_model(ARGS, seed=4, device="cuda")
        alone = [generate(model, p, max_new_tokens=N, eos_id=-1) for p in PROMPTS]
        d = feed(drafter(name, model), PROMPTS, alone, seed=1)
        for exact in (True, False):
            out = generate(model, PROMPTS, d, max_new_tokens=N, exact=exact, eos_id=-1)
            assert [len(o.tokens) for o in out] == [N, N], exact
            assert d.max_rows == 1 or sum(o.steps for o in out) < 2 * N, exact  # drafts were accepted


def test_the_stand_in_catches_a_host_index_in_a_program(monkeypatch):
    """Planted: the commit's moves, inside the step's program, indexed by a tensor made on the host."""
    def commit(cache, cache_rows, cur, path):
        dst = cur[:, None] + torch.arange(path.shape[-1])  # the fault: no device
        src = torch.where(path >= 0, cur[:, None] + path, dst)
        cache.kv[:, :, cache_rows[:, None], :, dst] = cache.kv[:, :, cache_rows[:, None], :, src]
    monkeypatch.setattr(KVCache, "commit", commit)
    with second_device():
        model = random_model(ARGS, seed=4, device="cuda")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            generate(model, PROMPTS, drafter("medusa", model), max_new_tokens=4, eos_id=-1)


def test_decode_py_runs_on_the_second_device(weights, tmp_path, monkeypatch):
    """decode.py --device cuda end to end on the stand-in: a checked decode and a bench, their own tensors (prompts,
    checks, the planner's measures) kept to one device."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))  # the stand-in's row costs stay out of the user's cache
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]))
    with second_device():
        code, out, err = call(decode_main, "--weights", weights, "--device", "cuda", "--method", "lookahead",
                              "--prompt", "def f(x):", "--max-new-tokens", 6, "--check")
        assert code == 0 and "identical" in err, err[-2000:]
        code, out, err = call(decode_main, "--weights", weights, "--device", "cuda", "--bench", "--methods",
                              "ar,lookahead", "--prompts", prompts, "--batch", "2", "--max-new-tokens", 6, "--json")
    assert code == 0 and [r["mismatches"] for r in json.loads(out.splitlines()[-1])["results"]] == [0] * 2, err[-2000:]
