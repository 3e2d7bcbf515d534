import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanospec.cache import KVCache


@given(st.data())
def test_commit_moves_each_accepted_path_in_order_and_nothing_else(data):
    """Two sequences' paths (node indices, growing, -1 padded) moved to their cursors at once, each in its own row."""
    S = data.draw(st.integers(4, 40))
    c = KVCache(n_layers=2, batch=2, n_slots=S, n_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    c.kv.normal_()
    kv0 = c.kv.clone()
    curs, paths = [], []
    for _ in range(2):
        cur = data.draw(st.integers(0, S - 2))
        room = S - 2 - cur  # the path's nodes sit in slots cur..S-2 (S-1: the trash slot)
        nodes = data.draw(st.lists(st.integers(1, room), unique=True, max_size=room)) if room else []
        curs.append(cur)
        paths.append([0] + sorted(nodes))
    E = max(map(len, paths)) + data.draw(st.integers(0, 2))
    c.commit(torch.tensor([0, 1]), torch.tensor(curs), torch.tensor([p + [-1] * (E - len(p)) for p in paths]))
    for b, (cur, path) in enumerate(zip(curs, paths)):
        for i, node in enumerate(path):
            assert torch.equal(c.kv[:, :, b, :, cur + i], kv0[:, :, b, :, cur + node])
        rest = [j for j in range(S) if not cur <= j < cur + len(path)]
        assert torch.equal(c.kv[:, :, b, :, rest], kv0[:, :, b, :, rest])


def test_reserve_takes_slots_below_trash():
    c = KVCache(1, 1, 20, 1, 2, torch.float32, "cpu")
    assert c.capacity == 19 and c.trash == 19
    assert c.reserve(4).tolist() == [15, 16, 17, 18]
    assert c.reserve(2).tolist() == [13, 14]
    assert c.capacity == 13
    with pytest.raises(ValueError):
        c.reserve(13)
