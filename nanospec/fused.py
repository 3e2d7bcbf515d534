"""A layer's products as nn.Linear, each tagged with its role; fused ones (q, k and v; gate and up) one kernel.

A product's role is its name in its layer, by which a method finds its own update of it (sdsat.Update). A fused
product stacks its parts' rows, as gpt-fast's wqkv does. Checkpoints keep the parts, as HF names them: the module's
state dict splits the fused weight on save and joins the parts on load, so a checkpoint never sees the fusion.
"""
import torch
import torch.nn as nn


class Product(nn.Linear):
    """An nn.Linear that knows its role in its layer."""

    def __init__(self, in_features: int, out_features: int, role: str, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.role = role


def fuse(module, name: str, in_features: int, parts: dict[str, int], bias: bool = False):
    """module.<name>: one product for the projections `parts` (name: output size), their weights' rows (and biases)
    stacked in parts' order: one kernel that reads its input once, where HF runs len(parts). The checkpoint keeps
    HF's parts (q_proj, k_proj, v_proj; gate_proj, up_proj): the state dict splits the fused weight on save and joins
    the parts on load."""
    setattr(module, name, Product(in_features, sum(parts.values()), name, bias))
    sizes, leaves = list(parts.values()), (".weight", ".bias")[:1 + bias]

    def split(mod, state, prefix, meta):
        for leaf in leaves:
            w = state.pop(prefix + name + leaf).split(sizes)
            state.update({prefix + p + leaf: t for p, t in zip(parts, w)})

    def join(state, prefix, *_):
        for leaf in leaves:
            keys = [prefix + p + leaf for p in parts]
            if all(k in state for k in keys):
                state[prefix + name + leaf] = torch.cat([state.pop(k) for k in keys])
    module._register_state_dict_hook(split)
    module._register_load_state_dict_pre_hook(join)
