"""Other engines' own speculative decoding, timed beside nanospec's methods in one benchmark run
(`decode.py --bench --peers transformers`): transformers' plain greedy generation, its prompt
lookup and its assisted generation, on the same weights, prompts and machine, interleaved with
the methods prompt by prompt. They are judged like the methods: tok/s, tokens per step (the model's
forwards: prompt lookup's and assisted generation's verifications, the assistant's not counted), the
speedup against the run's fastest AR, and how many prompts' tokens differ from AR's.
"""
import torch

from .. import NanospecError
from ..io.sources import base_of

SETTINGS = {"greedy": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 10}, "assisted": {}}


def hf_generate(hf, prompt: list[int], setting: str, max_new_tokens: int, eos_id: int, assistant=None) -> list[int]:
    """transformers' generate (AutoModelForCausalLM), greedy, in one of SETTINGS; the new ids."""
    extra = dict(SETTINGS[setting], **({"assistant_model": assistant} if setting == "assisted" else {}))
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        y = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                        eos_token_id=eos_id, pad_token_id=eos_id, **extra)
    return y[0, len(prompt):].tolist()


class Peer:
    def __init__(self, name: str, hf, setting: str, assistant=None):
        self.name, self.hf, self.setting, self.assistant = name, hf, setting, assistant
        self.steps = 0  # the last generation's forwards of the model (the first: the prompt's)

    def generate(self, prompt, max_new_tokens, eos_id) -> list[int]:
        forwards = []
        hook = self.hf.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            return hf_generate(self.hf, prompt, self.setting, max_new_tokens, eos_id, self.assistant)
        finally:
            hook.remove()
            self.steps = len(forwards)


def transformers_peers(weights, dtype, device, assistant_layers: int = 2) -> list[Peer]:
    """The three settings on the same weights; the assistant is the model cut to its first layers."""
    try:
        import transformers
    except ImportError:
        raise NanospecError("--peers transformers needs transformers: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = base_of(weights)
    load = lambda **kw: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device).eval()
    hf, assistant = load(), load(num_hidden_layers=assistant_layers)
    return [Peer(f"transformers {s}", hf, s, assistant if s == "assisted" else None) for s in SETTINGS]
