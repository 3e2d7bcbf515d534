"""A layer's products as nn.Linear, each tagged with its role; fused ones (q, k and v; gate and up) one kernel.

A product's role is its name in its layer, by which a method finds its own update of it (sdsat.Update); a fused
product also knows how its parts' rows interleave. Checkpoints keep the parts, as HF names them: the module's state
dict splits the fused weight on save and joins the parts on load, so a checkpoint never sees the fusion.
"""
import torch
import torch.nn as nn


class Product(nn.Linear):
    """An nn.Linear that knows its role in its layer and its parts' interleave (1: unfused or plainly stacked)."""

    def __init__(self, dim: int, out: int, role: str, interleave: int = 1, bias: bool = False):
        super().__init__(dim, out, bias=bias)
        self.role, self.interleave = role, interleave


def fuse(module, name: str, dim: int, parts: dict[str, int], interleave: int = 1, bias: bool = False):
    """module.<name>: one product for the projections `parts` (name: output size): one kernel that reads its input
    once, where HF runs len(parts). Its weight's rows (and bias's) come in `interleave` blocks, block i holding each
    part's i-th 1/interleave of rows in parts' order (Attention's qkv: a key head's query heads, key and value; 1:
    the parts stacked, MLP's gate_up). The checkpoint keeps HF's parts (q_proj, k_proj, v_proj; gate_proj, up_proj):
    the state dict splits the fused weight on save and joins the parts on load."""
    setattr(module, name, Product(dim, sum(parts.values()), name, interleave, bias))
    sizes, leaves = [n // interleave for n in parts.values()], (".weight", ".bias")[:1 + bias]

    def split(mod, state, prefix, meta):
        for leaf in leaves:
            w = state.pop(prefix + name + leaf)
            w = w.view(interleave, -1, *w.shape[1:]).split(sizes, 1)
            state.update({prefix + p + leaf: t.reshape(-1, *t.shape[2:]) for p, t in zip(parts, w)})

    def join(state, prefix, *_):
        for leaf in leaves:
            keys = [prefix + p + leaf for p in parts]
            if all(k in state for k in keys):
                w = [state.pop(k) for k in keys]
                w = [t.view(interleave, -1, *t.shape[1:]) for t in w]
                state[prefix + name + leaf] = torch.cat(w, 1).flatten(0, 1)
    module._register_state_dict_hook(split)
    module._register_load_state_dict_pre_hook(join)
