"""Tiny Llama GGUFs written with the gguf library itself, as llama.cpp's converter would write them:
Q and K rows permuted, 1-D norms in F32, a byte-level BPE tokenizer trained here. No download."""
import pytest

pytest.importorskip("gguf")  # an optional dependency: the tests that write GGUFs need it

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from helpers import CHAT, SPECIALS, bpe, random_model  # noqa: F401 (CHAT, SPECIALS: as before)
from nanospec.io.checkpoint import to_hf_name
from nanospec.io.gguf_export import add_hyperparameters
from nanospec.io.tokenizer import Tokenizer as SentencePiece
from nanospec.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # the gguf library dequantizes these but cannot quantize them
GGUF_NAMES = {v: k for k, v in {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}.items()}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute(): HF's rotate-half rows -> GGML's interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, T | None]:
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype in K_QUANTS:  # random blocks; bytes <= 0x1F keep every fp16 scale small and finite
        elems, nbytes = quants.GGML_QUANT_SIZES[T[qtype]]
        return rng.integers(0, 0x20, (w.shape[0], w.shape[1] // elems * nbytes), dtype=np.uint8), T[qtype]
    return quants.quantize(w.astype(np.float32), T[qtype]), T[qtype]


def llama_args(vocab_size: int, tie: bool = True) -> ModelArgs:
    # dim and hidden are multiples of 256, the K-quants' block
    return ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, intermediate_size=256,
                     rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=tie, bos_id=1, eos_id=2, pad_id=0)


def write_gguf(path: Path, qtype: str = "F32", arch: str = "llama", tie: bool = True, pre: str = "default",
               seed: int = 0, chat: bool = True, tokenizer: bool = True, merges: bool = True,
               add_bos: bool = False) -> Path:
    tokens, merge_list = bpe()
    args = llama_args(len(tokens), tie)
    model = random_model(args, seed=seed)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    add_config(w, args, context=512, file_type=0)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        if merges:
            w.add_token_merges(merge_list)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(add_bos)
    if chat:
        w.add_chat_template(CHAT)
    for gname, a in llama_cpp_tensors(model):
        if a.ndim == 1:
            w.add_tensor(gname, a.astype(np.float32))
        else:
            data, raw = encode(a, qtype, rng)
            w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_config(w: GGUFWriter, args: ModelArgs, context: int, file_type: int) -> None:
    """A Llama's hyperparameters as GGUF metadata."""
    add_hyperparameters(w, args, args.n_layers, context)
    w.add_vocab_size(args.vocab_size)
    w.add_file_type(file_type)


def llama_cpp_tensors(model):
    """(GGUF name, fp32 array) of each of the model's weights, as convert_hf_to_gguf.py names them:
    Q and K rows permuted; a tied lm_head left out."""
    a = model.args
    for name, t in model.state_dict().items():
        if a.tie_embeddings and name == "lm_head.weight":
            continue
        hf = to_hf_name(name).removesuffix(".weight")
        if hf.startswith("model.layers."):
            i, leaf = hf.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{LAYER[leaf]}.weight"
        else:
            gname = f"{GGUF_NAMES[hf]}.weight"
        x = t.detach().float().numpy()
        if gname.endswith(".attn_q.weight"):
            x = permute(x, a.n_heads)
        elif gname.endswith(".attn_k.weight"):
            x = permute(x, a.kv_heads)
        yield gname, np.ascontiguousarray(x, dtype=np.float32)


def transformers_model(path: Path):
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def ascii_model(tmp: Path, seed: int = 0) -> Path:
    """An HF directory (fp32, byte-level BPE tokenizer.json) whose greedy output never leaves the
    tokens whose text names them alone: the rows of the rest (partial UTF-8 bytes, specials but
    EOS) are zeroed in the tied embedding, so their logits are 0 where the others spread by
    several units. Servers that return token texts can then be mapped back to ids."""
    import shutil

    from nanospec.io.checkpoint import load, save
    from nanospec.io.convert import convert
    from nanospec.io.tokenizer_json import JsonTokenizer
    src = convert(write_gguf(tmp / "src.gguf", "F32", seed=seed), tmp / "src")
    tok = JsonTokenizer(src)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    unclear = [i for i, t in enumerate(texts) if texts.count(t) > 1 or "\ufffd" in t or i in (0, 1)]
    model = load(src)
    with torch.no_grad():
        model.embed.weight[unclear] = 0
    out = tmp / "ascii"
    save(model, out)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    return out


def write_llama_cpp_gguf(src, path: Path, qtype: str) -> Path:
    """The model src (weights/pylm) as convert_hf_to_gguf.py writes a Llama: Q/K rows permuted, 1-D norms in F32,
    matrices in qtype (Q8_0: rows whose length is not a multiple of its 32-element block in F16,
    as llama.cpp falls back). The vocabulary is the sentencepiece pieces as a `gpt2` tokenizer with
    one merge (nanospec's loader reads byte-level BPE only; these tests feed ids, not text)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    a = src.args
    w = gguf.GGUFWriter(str(path), "llama")
    add_config(w, a, context=a.max_seq_len, file_type={"F32": 0, "F16": 1, "Q8_0": 7}[qtype])
    sp = SentencePiece(ROOT / "weights" / "pylm" / "tokenizer.model").sp
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    w.add_token_list(pieces)
    have = set(pieces)  # one merge: the loader wants the key, and a merge must join two tokens into one
    w.add_token_merges([next(f"{p[:1]} {p[1:]}" for p in pieces if len(p) > 1 and {p[:1], p[1:], p} <= have)])
    w.add_bos_token_id(a.bos_id)
    w.add_eos_token_id(a.eos_id)
    w.add_pad_token_id(a.pad_id)
    w.add_add_bos_token(True)
    for gname, x in llama_cpp_tensors(src):
        if x.ndim == 1 or qtype == "F32":
            w.add_tensor(gname, x)
        elif qtype == "Q8_0" and x.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(gname, x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
