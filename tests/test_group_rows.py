"""Group rows on trees of many nodes: BiTA's mask tokens, Hidden Transfer's pseudo states and
SDSAT's adaptive tokens sit after a host node and see the committed slots, the host's path and
their own chain, nothing else. So a host's group computes what it computes when the host's path
is decoded alone as a chain, up to rounding (Hidden Transfer's maps multiply all hosts' states at
once, a product whose shape is the tree's): a group row that also sees a sibling branch, another
host's node or another group moves its states far past rounding."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import noisy, one_forward, path_to, random_model
from nanospec.methods.bita import BiTA, Tuning
from nanospec.methods.hidden_transfer import HiddenTransfer, Transfer
from nanospec.methods.sdsat import SDSAT, Delta
from nanospec.model import ModelArgs
from nanospec.tree import Tree

ARGS = ModelArgs(dim=24, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=37, hidden_dim=40)


def group_drafter(name, model):
    a = model.args
    return {
        "hidden_transfer": lambda: HiddenTransfer(noisy(Transfer(a.dim, [1, 2]), 1, 0.3), [(0,), (0, 0)]),
        "hidden_transfer-unchained": lambda: HiddenTransfer(noisy(Transfer(a.dim, [1, 2]), 1, 0.3), [(0,), (0, 0)],
                                                            chained=False),
        "bita-deep": lambda: BiTA(noisy(Tuning(a, 3, 4, "deep"), 2, 1.0), "efficient", 2),
        "bita-shallow": lambda: BiTA(noisy(Tuning(a, 2, 3, "shallow"), 2, 1.0), "full", 2),
        "bita-none": lambda: BiTA(noisy(Tuning(a, 3, 2, "none"), 2, 1.0), "efficient", 2),
        "sdsat": lambda: SDSAT(noisy(Delta(model, 4), 2, 0.3).to(model.embed.weight), k=3),
    }[name]()


def hosts(d, tree: Tree) -> list[int]:
    """The nodes that carry a group in this method's rows."""
    if isinstance(d, SDSAT):
        h = 0  # the end of the tree's top-1 chain (the lowest-index child at each depth)
        while h + 1 < len(tree) and h in tree.parents[h + 1:]:
            h = tree.parents.index(h, h + 1)
        return [h]
    return list(range(d.hosts(len(tree)) if isinstance(d, BiTA) else len(tree)))


@given(name=st.sampled_from(["hidden_transfer", "hidden_transfer-unchained", "bita-deep", "bita-shallow",
                             "bita-none", "sdsat"]),
       seed=st.integers(0, 2**16), plen=st.integers(1, 12), data=st.data())
def test_each_group_computes_what_its_path_alone_computes(name, seed, plen, data):
    model = random_model(ARGS, seed % 5)
    d = group_drafter(name, model)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, ARGS.vocab_size, (plen,), generator=g).tolist()
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, data.draw(st.integers(2, 9)))]
    tree = Tree(torch.randint(0, ARGS.vocab_size, (len(parents),), generator=g).tolist(), parents)
    _, drafts = one_forward(model, d, tree, prompt, exact=True)
    tokens = tree.token_list()
    for h in hosts(d, tree):
        path = path_to(tree, h)
        chain = Tree.chain(tokens[0], [tokens[i] for i in path[1:]])
        _, alone = one_forward(model, d, chain, prompt, exact=True)
        torch.testing.assert_close(drafts[h], alone[len(path) - 1], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"host {h} (path {path}) of tree {parents}: {m}")
