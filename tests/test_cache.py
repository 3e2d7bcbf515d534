import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanospec.cache import KVCache


@given(st.data())
def test_compact_moves_accepted_in_order_and_nothing_else(data):
    S = data.draw(st.integers(4, 40))
    c = KVCache(n_layers=2, batch=1, n_slots=S, n_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    c.k.normal_()
    c.v.normal_()
    k0, v0 = c.k.clone(), c.v.clone()
    n = data.draw(st.integers(1, S - 1))
    src = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=n))
    dst = data.draw(st.integers(0, S - len(src)))
    c.compact(src, dst)
    for i, s in enumerate(src):
        assert torch.equal(c.k[:, :, :, dst + i], k0[:, :, :, s])
        assert torch.equal(c.v[:, :, :, dst + i], v0[:, :, :, s])
    rest = [j for j in range(S) if not dst <= j < dst + len(src)]
    assert torch.equal(c.k[:, :, :, rest], k0[:, :, :, rest]) and torch.equal(c.v[:, :, :, rest], v0[:, :, :, rest])


def test_reserve_takes_slots_below_trash():
    c = KVCache(1, 1, 20, 1, 2, torch.float32, "cpu")
    assert c.capacity == 19 and c.trash == 19
    assert c.reserve(4).tolist() == [15, 16, 17, 18]
    assert c.reserve(2).tolist() == [13, 14]
    assert c.capacity == 13
    with pytest.raises(ValueError):
        c.reserve(13)
