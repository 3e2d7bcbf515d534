"""Group rows on trees of many nodes: BiTA's mask tokens, Hidden Transfer's pseudo states and
SDSAT's adaptive tokens sit after a host node and see the committed slots, the host's path and
their own chain, nothing else. So a host's group computes what it computes when the host's path
is decoded alone as a chain, up to rounding (Hidden Transfer's maps multiply all hosts' states at
once, a product whose shape is the tree's): a group row that also sees a sibling branch, another
host's node or another group moves its states far past rounding."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import METHODS, drafter, each_method, one_forward, path_to, random_model
from nanospec.drafter import Drafter
from nanospec.methods import METHODS as REGISTRY
from nanospec.model import ModelArgs
from nanospec.tree import Tree

ARGS = ModelArgs(dim=24, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=37, intermediate_size=40)
OWN_ROWS = [n for n in METHODS if REGISTRY[n].groups is not Drafter.groups]  # rows after the tree


@pytest.mark.parametrize("name", OWN_ROWS)
@each_method(25)
@given(seed=st.integers(0, 2**16), plen=st.integers(1, 12), data=st.data())
def test_each_group_computes_what_its_path_alone_computes(name, seed, plen, data):
    """Each of the method's random variants (Drafter.random: the seed picks one), every host its groups name."""
    model = random_model(ARGS, seed % 5)
    d = drafter(name, model, seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, ARGS.vocab_size, (plen,), generator=g).tolist()
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, data.draw(st.integers(2, 9)))]
    tree = Tree(torch.randint(0, ARGS.vocab_size, (len(parents),), generator=g).tolist(), parents)
    _, drafts = one_forward(model, d, tree, prompt, exact=True)
    tokens = tree.token_list()
    for h in d.groups(tree, len(tree)).hosts:
        path = path_to(tree, h)
        chain = Tree.chain(tokens[0], [tokens[i] for i in path[1:]])
        _, alone = one_forward(model, d, chain, prompt, exact=True)
        torch.testing.assert_close(drafts[h], alone[len(path) - 1], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"host {h} (path {path}) of tree {parents}: {m}")
