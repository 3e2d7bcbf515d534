"""HF checkpoints in and out: config.json, model.safetensors (or a sharded index), tokenizer.model.

The families are Llama's and its close kin, each a few switches of ModelArgs (FAMILIES): llama, mistral (a sliding
window), qwen2 (q/k/v biases), qwen3 (per-head q/k norms, its own head_dim). Any other model_type (MoE, MLA,
Gemma's norms...) is refused, naming it. Our module names differ from HF's in a few places; HF_NAMES is the one
map between them. Q/K need no permutation: HF checkpoints already use the rotate-half RoPE layout we use.
Methods' trained weights are separate files that record the fingerprint of their base model.
"""
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import NanospecError
from ..model import Llama, ModelArgs
from .files import atomic_write, fingerprint, hash_tensors

HF_NAMES = [  # (HF, ours); lm_head, mlp.*_proj and self_attn.*_proj keep their leaf names
    ("model.embed_tokens.", "embed."), ("model.norm.", "norm."), ("model.layers.", "layers."),
    (".self_attn.", ".attn."), (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".mlp_norm."),
]
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # model_type -> architecture
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def from_hf_name(name: str) -> str:
    for hf, ours in HF_NAMES:
        name = name.replace(hf, ours)
    return name


def to_hf_name(name: str) -> str:
    for hf, ours in reversed(HF_NAMES):  # infixes first, then the prefixes, anchored
        if not hf.startswith("."):
            name = hf + name[len(ours):] if name.startswith(ours) else name
        else:
            name = name.replace(ours, hf)
    return name


def family(args: ModelArgs) -> str:
    """The model_type whose config.json describes args."""
    if args.qk_norm and args.qkv_bias:
        raise NanospecError("no HF family has q/k norms and q/k/v biases without an o_proj bias")
    return "qwen3" if args.qk_norm else "qwen2" if args.qkv_bias else "mistral" if args.sliding_window else "llama"


def sliding_window(cfg: dict, kind: str) -> int | None:
    """The window every layer slides (None: none). Qwen's windows apply to the layers from max_window_layers on
    (or as layer_types says), Mistral's to all; one on some layers only is refused."""
    if kind == "llama" or kind != "mistral" and not cfg.get("use_sliding_window"):
        return None
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} must be at least 1")
    if window is None or kind == "mistral":
        return window
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(n)]
    if len(set(types)) > 1:
        raise ValueError("a sliding window on some layers only (layer_types) is not supported")
    return window if types[0] == "sliding_attention" else None


def from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from an HF config.json of one of FAMILIES; what our model cannot run is refused."""
    kind = cfg.get("model_type", "llama")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported: nanospec runs {', '.join(FAMILIES)}")
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its own (no key)
        if cfg.get(key):
            raise ValueError(f"{key}=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    # transformers >= 5 nests rope settings in rope_parameters; older versions use
    # rope_theta + rope_scaling ({"type"|"rope_type": ...}).
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
    eos = cfg.get("eos_token_id")
    return ModelArgs(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads"),
        vocab_size=cfg["vocab_size"], intermediate_size=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim", 128 if kind == "qwen3" else None), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        bos_id=cfg.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos,
        pad_id=cfg.get("pad_token_id"), qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
        sliding_window=sliding_window(cfg, kind))


def to_hf_config(args: ModelArgs) -> dict:
    """An HF config.json for args, of its family (transformers loads it unchanged)."""
    rope, kind, window = {"rope_type": "default", **(args.rope_scaling or {})}, family(args), args.sliding_window
    slides = {"mistral": {"sliding_window": window}, "llama": {}}.get(kind, {  # Qwen's: every layer's, or none
        "use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0})
    return {
        "architectures": [FAMILIES[kind]], "model_type": kind, **slides,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size, "intermediate_size": args.intermediate_size,
        "head_dim": args.hd, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "rope_theta": args.rope_theta, "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "rope_parameters": {"rope_theta": args.rope_theta, **rope},
        "tie_word_embeddings": args.tie_embeddings, "max_position_embeddings": args.max_seq_len,
        "bos_token_id": args.bos_id,
        "eos_token_id": args.eos_id, "pad_token_id": args.pad_id,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def load_args(path) -> ModelArgs:
    path = Path(path)
    if not path.is_dir():
        raise NanospecError(f"no weights directory at {path}: pass --weights DIR with an HF checkpoint")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise NanospecError(f"{path} has no config.json: is it an HF checkpoint directory?")
    try:
        return from_hf_config(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise NanospecError(f"{cfg_file} is not valid JSON ({e})") from None
    except KeyError as e:
        raise NanospecError(f"{cfg_file} lacks the key {e}") from None
    except (ValueError, TypeError) as e:
        raise NanospecError(f"{cfg_file}: {e}") from None


def load_tensors(path: Path) -> dict:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise NanospecError(f"{path} has no model.safetensors (or model.safetensors.index.json)")
    state = {}
    for f in files:
        with safe_open(path / f, framework="pt") as sf:
            for k in sf.keys():
                if not k.endswith("rotary_emb.inv_freq"):  # a buffer some old exports saved
                    state[from_hf_name(k)] = sf.get_tensor(k)
    return state


def load(path, dtype=torch.float32, device="cpu") -> Llama:
    """Load an HF directory; weights are cast to dtype (upcasting bf16 to fp32 is exact). The
    model's fingerprint names the stored weights, before the cast (files.fingerprint)."""
    path = Path(path)
    args = load_args(path)
    stored = load_tensors(path)
    state = {k: v.to(device=device, dtype=dtype) for k, v in stored.items()}
    if args.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("embed.weight"))
    with torch.device("meta"):
        model = Llama(args)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()
        raise NanospecError(f"weights in {path} do not match its config.json: "
                            f"{' '.join(first[1:2] or first[:1]).strip()}") from None
    if args.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_rope(device)
    model.fingerprint = hash_tensors({k: stored.get(k, stored.get("embed.weight")) for k in model.state_dict()})
    return model.eval()


def save(model: Llama, path, dtype=None, tokenizer_model=None) -> None:
    """Write an HF-format directory (each file atomically) that transformers loads unchanged."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {to_hf_name(k): v.detach().to(dtype or v.dtype).contiguous().cpu()
             for k, v in model.state_dict().items()
             if not (model.args.tie_embeddings and k == "lm_head.weight")}
    cfg = to_hf_config(model.args)
    cfg["torch_dtype"] = str(dtype or model.embed.weight.dtype).removeprefix("torch.")
    atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    atomic_write(path / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    if tokenizer_model is not None:
        data = Path(tokenizer_model).read_bytes()
        atomic_write(path / "tokenizer.model", lambda p: p.write_bytes(data))


def save_drafter(path: Path, module: torch.nn.Module, meta: dict) -> None:
    """A method's trained weights (bf16) with JSON metadata; meta should carry base_fingerprint."""
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in module.state_dict().items()}  # integers (token ids) as they are
    atomic_write(path, lambda p: save_file(state, str(p), metadata={k: json.dumps(v) for k, v in meta.items()}))


def load_drafter_file(path: Path, model, train_cmd: str) -> tuple[dict, dict]:
    """(tensors, metadata) of a drafter file, refusing one trained for another base model."""
    if not path.is_file():
        raise NanospecError(f"no {path.name} in {path.parent}: train it with `{train_cmd}`")
    with safe_open(path, framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp = fingerprint(model)
    if meta.get("base_fingerprint") != fp:
        raise NanospecError(f"{path} was trained for another base model (fingerprint "
                            f"{meta.get('base_fingerprint')}, these weights {fp}): retrain with `{train_cmd}`")
    w = model.embed.weight
    return {k: v.to(device=w.device, dtype=w.dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()}, meta


def load_trained(model, path: Path, train_cmd: str, build):
    """A drafter's trained module: build(meta) makes it, the file's tensors fill it, on the model's
    device and dtype. Returns (module, metadata); refuses a file trained for another base model."""
    tensors, meta = load_drafter_file(path, model, train_cmd)
    module = build(meta)
    module.load_state_dict(tensors)
    return module.to(model.embed.weight).eval(), meta
