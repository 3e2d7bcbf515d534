"""Fused projections: several of a layer's products (q, k and v; gate and up) as one nn.Linear, one kernel.

Checkpoints keep the parts, as HF names them: the module's state dict splits the fused weight on save and joins
the parts on load, so a checkpoint never sees the fusion.
"""
import torch
import torch.nn as nn


def fuse(module, name: str, dim: int, parts: dict[str, int], interleave: int = 1, bias: bool = False):
    """module.<name>: one product for the projections `parts` (name: output size), their weights' rows (and biases)
    interleaved in `interleave` blocks (each part's rows split in as many: a key head's q, k and v together): one
    kernel, not len(parts)."""
    setattr(module, name, nn.Linear(dim, sum(parts.values()), bias=bias))
    fused = getattr(module, name)
    fused.interleave, fused.role = interleave, name  # role: the product's name in its layer
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
