"""A GGUF (llama.cpp's format) as an HF directory, once: config.json, model.safetensors
(fp32), tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json.
And back: an HF directory as an F32 GGUF (gguf_export.py), so llama.cpp runs nanospec's weights.
The architectures are llama.cpp's llama (Llama and Mistral: its `llama` holds both), qwen2 (q/k/v
biases) and qwen3 (per-head q/k norms); any other is refused, naming it.

    python -m nanospec.io.convert FILE.gguf DIR
    python -m nanospec.io.convert DIR OUT.gguf [--layers N]

Tensors are dequantized with the `gguf` library, in fp32 as llama.cpp computes them (Q4_1:
d * q + m per weight), so the fp32 directory is the GGUF's model itself (a Q4_1 file is of course
an approximation of the model it was quantized from). For its `llama` architecture llama.cpp
stores the rows of Q and K permuted for its RoPE layout (convert_hf_to_gguf.py's `permute`), and
unpermute() undoes that; qwen2 and qwen3 rotate halves as HF does and are stored unpermuted. The
config and the tokenizer come from the file's metadata (a sliding window from attention.sliding_window).
Everything is written into a temporary directory that is renamed into place at the end, so an
error leaves nothing behind. decode.py and the rest call this through sources.resolve(), which
keeps one converted copy per GGUF in a cache.
"""
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .. import ArgumentParser, NanospecError, cli
from ..model import ModelArgs
from . import gguf_tokenizer
from .checkpoint import to_hf_config
from .gguf_export import ARCHS, LAYER_NAMES, TOP_NAMES, export

SUPPORTED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def gguf_lib():
    """The gguf package, imported only where a GGUF is read: everything else runs without it."""
    try:
        import gguf
    except ImportError:
        raise NanospecError("reading a GGUF file needs the gguf package: pip install gguf") from None
    return gguf


def open_gguf(path: Path):
    if not path.is_file():
        raise NanospecError(f"no GGUF file at {path}")
    gguf = gguf_lib()
    try:
        reader = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:  # a truncated or corrupted file fails anywhere in the parser
        raise NanospecError(f"{path} is not a readable GGUF file (truncated or corrupted?): "
                            f"{type(e).__name__}: {str(e).strip()[:200]}") from None
    return reader, meta


def model_args(meta: dict, tensor_names: set) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise NanospecError(f"the GGUF holds a {arch!r} model; nanospec runs the architectures "
                            f"{', '.join(ARCHS)} (general.architecture)")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    missing = [k for k in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
               if get(k) is None]
    if missing:
        raise NanospecError(f"the GGUF lacks {arch}.{missing[0]}")
    if "rope_freqs.weight" in tensor_names or get("rope.scaling.type", "none") not in ("none", "linear"):
        raise NanospecError("the GGUF uses a RoPE scaling nanospec does not convert (rope_freqs or "
                            f"{get('rope.scaling.type')!r}); plain and linear RoPE only")
    n_heads, dim = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length", dim // n_heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise NanospecError("the GGUF rotates only part of each head (rope.dimension_count != head_dim)")
    scaling = None
    if get("rope.scaling.type", "none") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    tokens = meta.get("tokenizer.ggml.tokens")
    try:
        return ModelArgs(
            dim=dim, n_layers=get("block_count"), n_heads=n_heads, n_kv_heads=get("attention.head_count_kv", n_heads),
            vocab_size=get("vocab_size") or len(tokens or []), intermediate_size=get("feed_forward_length"),
            head_dim=head_dim, norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            tie_embeddings="output.weight" not in tensor_names, max_seq_len=get("context_length", 2048),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"), qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
            sliding_window=get("attention.sliding_window"))
    except (ValueError, TypeError) as e:
        raise NanospecError(f"the GGUF's {arch}.* metadata is not a valid config: {e}") from None


def hf_name(name: str) -> str:
    stem, _, leaf = name.rpartition(".")  # leaf: weight
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{leaf}"
    if stem in TOP_NAMES and leaf == "weight":
        return f"{TOP_NAMES[stem]}.{leaf}"
    raise NanospecError(f"the GGUF has a tensor nanospec does not know: {name}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: its permute() reshapes (n_head, 2, hd/2, dim) -> (n_head, hd/2, 2, dim)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)  # (n_head, 2, hd/2, dim)


def layer_shapes(args: ModelArgs) -> dict:
    """A layer's tensors (HF names, after model.layers.N.) and their shapes, as args' family has them."""
    H, Hkv = args.n_heads * args.hd, args.kv_heads * args.hd
    shapes = {"input_layernorm.weight": (args.dim,), "post_attention_layernorm.weight": (args.dim,),
              "self_attn.q_proj.weight": (H, args.dim), "self_attn.k_proj.weight": (Hkv, args.dim),
              "self_attn.v_proj.weight": (Hkv, args.dim), "self_attn.o_proj.weight": (args.dim, H),
              "mlp.gate_proj.weight": (args.intermediate_size, args.dim),
              "mlp.up_proj.weight": (args.intermediate_size, args.dim),
              "mlp.down_proj.weight": (args.dim, args.intermediate_size)}
    if args.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (H,), "self_attn.k_proj.bias": (Hkv,), "self_attn.v_proj.bias": (Hkv,)})
    if args.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (args.hd,), "self_attn.k_norm.weight": (args.hd,)})
    return shapes


def tensors(reader, args: ModelArgs, permuted: bool) -> dict:
    """HF name -> fp32 tensor, dequantized, Q/K rows in HF order (unpermuted if `permuted`), shapes checked."""
    expect = {f"model.layers.{i}.{n}": s for i in range(args.n_layers) for n, s in layer_shapes(args).items()}
    expect.update({"model.embed_tokens.weight": (args.vocab_size, args.dim), "model.norm.weight": (args.dim,)})
    if not args.tie_embeddings:
        expect["lm_head.weight"] = (args.vocab_size, args.dim)
    out = {}
    for t in reader.tensors:
        name, kind = hf_name(t.name), gguf_lib().GGMLQuantizationType(t.tensor_type).name
        if kind not in SUPPORTED:
            raise NanospecError(f"tensor {t.name} is {kind}, a type nanospec does not load "
                                f"(supported: {', '.join(SUPPORTED)})")
        try:
            w = np.asarray(gguf_lib().dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dimensions innermost first
        except Exception as e:
            raise NanospecError(f"tensor {t.name} cannot be read (truncated or corrupted file?): {e}") from None
        if name not in expect or w.shape != expect[name]:
            raise NanospecError(f"tensor {t.name} has shape {w.shape}, but the metadata implies "
                                f"{expect.get(name, 'no such tensor')}")
        if not np.isfinite(w).all():
            raise NanospecError(f"tensor {t.name} holds non-finite values: the file is corrupted")
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute(w, args.n_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute(w, args.kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: F32 data is a view of the file
    if missing := sorted(set(expect) - set(out)):
        raise NanospecError(f"the GGUF lacks the tensor for {missing[0]} ({len(missing)} missing)")
    return out


def convert(gguf_path, out, sha256: str | None = None) -> Path:
    """Write the HF directory `out` (which must not exist yet, or be empty) from a GGUF file."""
    gguf_path, out = Path(gguf_path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NanospecError(f"{out} already exists and is not an empty directory")
    reader, meta = open_gguf(gguf_path)
    names = {t.name for t in reader.tensors}
    args = model_args(meta, names)
    tok_json, tok_config = gguf_tokenizer.build(meta, args.max_seq_len)  # fail on the tokenizer before the work
    state = tensors(reader, args, permuted=meta["general.architecture"] == "llama")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cfg = {**to_hf_config(args), "torch_dtype": "float32"}
        gen = {"bos_token_id": args.bos_id, "eos_token_id": args.eos_id}
        types = dict(Counter(gguf_lib().GGMLQuantizationType(t.tensor_type).name for t in reader.tensors))
        source = {"gguf": gguf_path.name, "sha256": sha256, "name": meta.get("general.name"),
                  "license": meta.get("general.license"), "tensor_types": types}
        for fname, obj in (("config.json", cfg), ("generation_config.json", gen), ("nanospec_source.json", source)):
            (tmp / fname).write_text(json.dumps(obj, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.is_dir():
            out.rmdir()  # empty: checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("source", help="a .gguf file, or an HF directory")
    p.add_argument("out", help="the HF directory to write (must not exist yet), or OUT.gguf for a directory")
    p.add_argument("--layers", type=int, help="DIR -> OUT.gguf: keep only the first N layers (a draft model)")
    args = p.parse_args(argv)
    if Path(args.source).is_dir():
        out = export(args.source, args.out, args.layers)
    elif args.layers is not None:
        raise NanospecError("--layers applies to DIR -> OUT.gguf, not to reading a GGUF")
    else:
        out = convert(args.source, args.out)
    print(f"wrote {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    cli(main)
