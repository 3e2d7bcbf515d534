"""An HF directory as an F32 GGUF file, so that llama.cpp runs the very weights nanospec runs.

    python -m nanospec.io.convert DIR OUT.gguf [--layers N]

The inverse of convert.py: each family goes in as llama.cpp's converter writes it (llama and mistral
as its `llama`, qwen2 and qwen3 as themselves), HF names become GGUF names, Q and K rows are
permuted into llama.cpp's RoPE layout again for `llama` only (convert_hf_to_gguf.py's `permute`),
every matrix is written in F32 (the 1-D norms and biases are F32 in any GGUF), and the config goes
into `<arch>.*` metadata (a sliding window as attention.sliding_window, which llama.cpp's llama,
qwen2 and qwen3 do not apply: past the window its output is not the model's). The tokenizer goes in
as llama.cpp reads it: a byte-level BPE tokenizer.json as `gpt2` (tokens, merges, types and the
`pre` name whose split it performs, found by building each of gguf_tokenizer.PRE and comparing),
a sentencepiece tokenizer.model as `llama` (pieces, scores, types). The chat template comes
along. layers=N keeps the first N layers only: a small draft model made of the model itself.
The file is written under a temporary name and renamed into place.
"""
import json
from pathlib import Path

import numpy as np

from .. import NanospecError
from ..model import ModelArgs
from .checkpoint import family, load_args, load_tensors, to_hf_name
from .files import atomic_write

LAYER_NAMES = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
ARCHS = ("llama", "qwen2", "qwen3")  # llama.cpp's architectures for checkpoint.FAMILIES (mistral: its llama)
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER = {hf: g for g, hf in LAYER_NAMES.items()}
GGUF_TOP = {hf: g for g, hf in TOP_NAMES.items()}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows -> llama.cpp's interleaved rows (convert.unpermute's inverse)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str | None:
    stem, _, leaf = hf.rpartition(".")  # leaf: weight or bias
    if stem in GGUF_TOP and leaf == "weight":
        return f"{GGUF_TOP[stem]}.weight"
    parts = stem.split(".", 3)  # model, layers, N, module
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in GGUF_LAYER:
        return f"blk.{parts[2]}.{GGUF_LAYER[parts[3]]}.{leaf}"
    return None


def src_meta(src: Path) -> dict:  # what convert.py recorded about a GGUF a directory came from
    from .tokenizer_json import read_json
    return read_json(src / "nanospec_source.json")


def add_hyperparameters(w, args: ModelArgs, layers: int, context: int) -> None:
    """A model's shape as llama.cpp's metadata keys (its converter's and this exporter's)."""
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_dimension_count(args.hd)
    if args.sliding_window:
        w.add_sliding_window(args.sliding_window)


def write_config(w, src: Path, args: ModelArgs, layers: int, name: str) -> None:
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", "linear") != "linear":
        raise NanospecError(f"rope_scaling {scaling['rope_type']!r} has no plain GGUF form here (linear only)")
    w.add_name(name)
    source = src_meta(src)
    if source.get("license"):
        w.add_license(source["license"])
    w.add_file_type(0)  # ALL_F32
    add_hyperparameters(w, args, layers, args.max_seq_len)
    if args.hd != args.dim // args.n_heads:
        w.add_key_length(args.hd)
        w.add_value_length(args.hd)
    if scaling:
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    w.add_vocab_size(args.vocab_size)


def bpe_pre_name(pre_tokenizer: dict) -> str:
    """The llama.cpp `pre` name whose split a tokenizer.json's pre-tokenizer performs."""
    from tokenizers import Tokenizer, models

    from .gguf_tokenizer import PRE

    def essential(node):  # the fields that change the split (ByteLevel also serializes trim_offsets)
        if isinstance(node, dict):
            return {k: essential(v) for k, v in node.items() if k not in ("trim_offsets",)}
        return [essential(v) for v in node] if isinstance(node, list) else node
    for name, make in PRE.items():
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = make()[0]
        if essential(json.loads(tk.to_str())["pre_tokenizer"]) == essential(pre_tokenizer):
            return name
    raise NanospecError("the tokenizer.json's pre-tokenizer is not one llama.cpp names "
                        f"({', '.join(PRE)}); llama.cpp would split the text otherwise")


def write_bpe(w, path: Path, args: ModelArgs) -> None:
    from .tokenizer_json import JsonTokenizer
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel" or data.get("normalizer"):
        raise NanospecError(f"{path}/tokenizer.json is not a byte-level BPE tokenizer (no normalizer, ByteLevel "
                            "decoder): llama.cpp's `gpt2` tokenizer could not reproduce it")
    tok = JsonTokenizer(path)
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
    tokens = [None] * tok.vocab_size
    for t, i in vocab.items():
        if 0 <= i < len(tokens):
            tokens[i] = t
    if None in tokens:
        raise NanospecError(f"{path}/tokenizer.json has gaps in its ids (id {tokens.index(None)} is no token)")
    added = {t["content"]: t.get("special", False) for t in data.get("added_tokens", [])}
    types = [(CONTROL if added[t] else USER_DEFINED) if t in added else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(bpe_pre_name(data.get("pre_tokenizer") or {}))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = tok.encode("a")
    w.add_add_bos_token(tok.bos_id is not None and ids[:1] == [tok.bos_id])
    w.add_add_eos_token(tok.eos_id is not None and ids[-1:] == [tok.eos_id])
    for add, tid in ((w.add_bos_token_id, args.bos_id), (w.add_eos_token_id, args.eos_id),
                     (w.add_pad_token_id, args.pad_id), (w.add_unk_token_id, tok.special("unk_token", None))):
        # config.json's ids (what nanospec stops at), tokenizer_config.json's unk_token
        if tid is not None:
            add(tid)
    template = tok.config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        w.add_chat_template(template)


def write_spm(w, path: Path) -> None:
    from .tokenizer import Tokenizer
    sp = Tokenizer(path / "tokenizer.model").sp
    n = sp.get_piece_size()
    kinds = [(sp.is_control, CONTROL), (sp.is_unknown, UNKNOWN), (sp.is_byte, BYTE), (sp.is_unused, UNUSED)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([float(sp.get_score(i)) for i in range(n)])
    w.add_token_types([next((t for f, t in kinds if f(i)), NORMAL) for i in range(n)])
    w.add_add_space_prefix(sp.encode("a", out_type=str)[0].startswith("\u2581"))  # the dummy prefix, as trained
    w.add_add_bos_token(sp.bos_id() >= 0)  # nanospec's Tokenizer prepends BOS, as Llama's does
    w.add_add_eos_token(False)
    for add, tid in ((w.add_bos_token_id, sp.bos_id()), (w.add_eos_token_id, sp.eos_id()),
                     (w.add_unk_token_id, sp.unk_id()), (w.add_pad_token_id, sp.pad_id())):
        if tid >= 0:
            add(tid)


def export(src, out, layers: int | None = None) -> Path:
    """Write the F32 GGUF `out` from the HF directory `src` (first `layers` layers only, if given)."""
    import gguf
    src, out = Path(src), Path(out)
    args = load_args(src)
    arch = {"mistral": "llama"}.get(family(args), family(args))
    layers = args.n_layers if layers is None else layers
    if not 1 <= layers <= args.n_layers:
        raise NanospecError(f"--layers {layers}: the model has {args.n_layers} layers")
    if out.suffix.lower() != ".gguf":
        raise NanospecError(f"{out}: the output must be a .gguf file")
    if not out.parent.is_dir():
        raise NanospecError(f"{out}: its directory does not exist")
    tensors = {}
    for name, t in sorted(load_tensors(src).items()):
        hf = to_hf_name(name)
        g = gguf_name(hf)
        if g is None:
            raise NanospecError(f"{src} has a tensor llama.cpp's {arch} does not know: {hf}")
        if g.startswith("blk.") and int(g.split(".")[1]) >= layers:
            continue
        a = t.float().numpy()
        if arch == "llama" and g.endswith("attn_q.weight"):
            a = permute(a, args.n_heads)
        elif arch == "llama" and g.endswith("attn_k.weight"):
            a = permute(a, args.kv_heads)
        tensors[g] = np.ascontiguousarray(a, dtype=np.float32)
    if args.tie_embeddings:
        tensors.pop("output.weight", None)  # llama.cpp ties when the file has no output.weight

    def write(tmp: Path):
        w = gguf.GGUFWriter(str(tmp), arch)
        name = src.name if layers == args.n_layers else f"{src.name} (first {layers} layers)"
        write_config(w, src, args, layers, name)
        if (src / "tokenizer.json").is_file():
            write_bpe(w, src, args)
        elif (src / "tokenizer.model").is_file():
            write_spm(w, src)
        else:
            raise NanospecError(f"{src} has no tokenizer.json or tokenizer.model for llama.cpp to read")
        for g, a in tensors.items():
            w.add_tensor(g, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    atomic_write(out, write)
    return out
