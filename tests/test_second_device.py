"""The second-device stand-in (second_device.py) refuses what CUDA refuses, allows what CUDA allows, and computes what
the host computes."""
import pytest
import torch

from second_device import SHOWN, OnDevice, second_device


def test_the_stand_in_keeps_cudas_rules(tmp_path, monkeypatch):
    with second_device(monkeypatch):
        x = torch.arange(4.0).to("cuda")
        assert x.device == SHOWN and torch.zeros(2, device="cuda").device == SHOWN and x.cuda() is x
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)  # a host tensor in a device op
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(4)[torch.tensor([1, 2], device="cuda")]  # device indices into a host tensor
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert (x * torch.tensor(2.0)).device == SHOWN  # a 0-dim host tensor is a scalar
        assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]  # host indices into a device tensor
        back = x.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu" and back.tolist() == [0.0, 1.0, 2.0, 3.0]
        y = torch.zeros(4)
        y.copy_(x)  # copies cross
        assert y.tolist() == back.tolist() and type(x.to(torch.bfloat16)) is OnDevice
        torch.save({"x": x}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt")["x"], back)


def test_the_stand_in_trains_as_the_host_does(monkeypatch):
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
    with second_device(monkeypatch):
        there, on_device = steps("cuda")
    assert host == {"cpu"} and there == {SHOWN.type} and torch.equal(on_host, on_device)
