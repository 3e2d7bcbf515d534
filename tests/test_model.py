"""Our Llama against transformers' LlamaForCausalLM, config parsing, checkpoint round trips."""
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import FAMILIES, family_args, full_logits, keys_in_order, model_args, random_model, rows_by_index
from nanospec import NanospecError, devices
from nanospec.cache import Block, KVCache
from nanospec.engine import generate
from nanospec.forward import Forward, angles, context, exact_layer, run
from nanospec.io.checkpoint import from_hf_config, load, load_args, save, to_hf_config
from nanospec.model import Llama, ModelArgs
from nanospec.tree import Tree

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
CONFIGS = {  # name: LlamaConfig kwargs
    "mha": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48),
    "gqa-odd": dict(hidden_size=30, num_attention_heads=6, num_key_value_heads=2, head_dim=6, intermediate_size=37),
    "linear-rope": dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3-rope-tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                             rope_scaling=dict(LLAMA3), tie_word_embeddings=True, rope_theta=500000.0),
}


def hf_model(name, vocab=61, layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=256,
                                   **CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits out so greedy near-ties are rare
        for n, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 if p.dim() == 2 else torch.rand_like(p) + 0.5)
    return hf


def hf_and_ours(tmp_path, name):
    """A transformers model and ours loaded from its save_pretrained directory."""
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    return hf, load(tmp_path)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tmp_path, name):
    hf, ours = hf_and_ours(tmp_path, name)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits[0]
    for exact in (False, True):
        torch.testing.assert_close(full_logits(ours, ids[0].tolist(), exact), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_match_transformers_generate(tmp_path, name):
    hf, ours = hf_and_ours(tmp_path, name)
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    hf.generation_config.eos_token_id = None
    ref = hf.generate(ids, max_new_tokens=30, do_sample=False)[0, 9:].tolist()
    for exact in (False, True):
        assert generate(ours, ids[0].tolist(), max_new_tokens=30, exact=exact, eos_id=-1).tokens == ref


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("gqa-odd")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = list(range(1, 30))
    torch.testing.assert_close(full_logits(load(tmp_path), ids, False), hf(torch.tensor([ids])).logits[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_our_checkpoint_loads_in_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    model = random_model(ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=33, intermediate_size=30,
                                   rope_scaling=dict(LLAMA3), tie_embeddings=tied))
    save(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = list(range(33))
    torch.testing.assert_close(full_logits(model, ids, False), hf(torch.tensor([ids])).logits[0],
                               rtol=1e-5, atol=1e-5)


def test_save_load_roundtrip_bf16_is_exact_upcast(tmp_path):
    model = random_model(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=20, intermediate_size=24))
    save(model, tmp_path, dtype=torch.bfloat16)
    back = load(tmp_path, torch.float32)
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a.bfloat16().float(), b), k
    assert not list(tmp_path.glob(".*tmp*")), "atomic writes leave no temporary files"


@pytest.mark.parametrize("cast", ["to", "load"])
def test_a_bf16_model_rotates_with_fp32_rope_constants(tmp_path, cast):
    """A model cast to bf16 (model.to, or loaded as bf16) computes RoPE's tables from constants made in fp32: its
    tables, exact and fast, are bitwise those of a model never cast, rounded once, and over a long prompt its
    logits stay within bf16's noise of the same weights computed in fp32. Constants cast with the weights pass
    every test that compares the cast model with itself (its AR run shares them), and move late positions'
    logits far beyond that noise."""
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, intermediate_size=48,
                     rope_scaling=LLAMA3)
    ref = random_model(args, seed=1).to(torch.bfloat16).float()  # bf16's weights, computed in fp32
    if cast == "to":
        model = random_model(args, seed=1, dtype=torch.bfloat16)
    else:
        save(ref, tmp_path)
        model = load(tmp_path, torch.bfloat16)
    pos = torch.arange(0, 8000, 7).view(1, -1)
    for dev in (None, devices.of("cpu")):  # fast mode's, and exact mode's on this device
        fresh = angles(Llama(args), pos, dev)  # made at construction, in fp32
        assert all(torch.equal(a, b.bfloat16()) for a, b in zip(angles(model, pos, dev), fresh))
    ids = torch.randint(0, 61, (300,), generator=torch.Generator().manual_seed(0)).tolist()  # fast mode: bf16's
    assert (full_logits(model, ids, False).float() - full_logits(ref, ids, False)).abs().max() < 0.3  # exact is slow


def test_config_styles_and_errors(tmp_path):
    base = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10, intermediate_size=20)
    old = from_hf_config({**base, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = from_hf_config({**base, "rope_parameters": {"rope_theta": 500.0, "rope_type": "linear", "factor": 2.0}})
    assert old == new and old.rope_scaling == {"rope_type": "linear", "factor": 2.0} and old.rope_theta == 500.0
    assert from_hf_config(to_hf_config(ModelArgs(dim=8, n_heads=2, rope_scaling=LLAMA3))).rope_scaling == LLAMA3
    cases = {"{not json": "not valid JSON", json.dumps({**base, "hidden_size": None} | {"x": 1})[:-1]: "not valid JSON",
             json.dumps({k: v for k, v in base.items() if k != "vocab_size"}): "lacks the key 'vocab_size'",
             json.dumps({**base, "attention_bias": True}): "attention_bias",
             json.dumps({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}): "not supported"}
    for text, msg in cases.items():
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(NanospecError, match=msg):
            load_args(tmp_path)
    for bad in ({**base, "num_key_value_heads": 3}, {**base, "head_dim": 5}):
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(NanospecError, match="head"):
            load_args(tmp_path)
    with pytest.raises(NanospecError, match="no weights directory"):
        load(tmp_path / "missing")


def test_weights_that_do_not_match_config(tmp_path):
    model = random_model(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=20, intermediate_size=24))
    save(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 25}))
    with pytest.raises(NanospecError, match="do not match"):
        load(tmp_path)


def test_batch_rows_are_independent():
    """The model keeps a batch dimension: each sequence of a batch gets its own result."""
    model = random_model(ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, intermediate_size=30))
    a, b = list(range(1, 13)), list(range(20, 32))
    one = [full_logits(model, ids, False) for ids in (a, b)]
    blk = Tree.chain(a[0], a[1:]).block(0)
    blk.tokens = torch.tensor([a, b])
    blk.pos, blk.committed, blk.extra = (t.expand(2, *t.shape[1:]) for t in (blk.pos, blk.committed, blk.extra))
    both = run(model, blk, KVCache.for_model(model, 13, batch=2), False)
    torch.testing.assert_close(both[0], one[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], one[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_layer_is_the_layer(family):
    """forward.exact_layer, the layer exact mode runs (each residual added in its product's kernel), is model.Layer's
    forward to rounding: both over one exact context and cache, on a random GQA layer of each family."""
    args = ModelArgs(dim=24, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=40, intermediate_size=30)
    model = random_model(family_args(args, family))
    ids = list(range(3, 23))
    block = Tree.chain(ids[0], ids[1:]).block(0)
    f = Forward.on_cache(model, block, KVCache.for_model(model, 24), True)
    layer, x = model.layers[0], model.embed(block.tokens)
    with torch.no_grad():
        ours, ref = exact_layer(layer, x, f.ctx, f.kv[0]), layer(x, f.ctx, f.kv[0])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_exact_rows_read_their_keys_in_canonical_order():
    """Each exact row reduces over the committed slots 0..committed-1 in order, then its extra slots as given (a tree
    node's ancestors by depth, itself last), whatever its tail: a root and two children after 5 committed slots,
    and the same tree after 2, its rows seeing a reserved slot (9) first."""
    model = random_model(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=20, intermediate_size=24))
    tree = Tree([9, 4, 8], [-1, 0, 0]).block(5)
    paths = [[5], [5, 6], [5, 7]]
    assert tree.extra[0].tolist() == [p + [-1] * (2 - len(p)) for p in paths]
    extra = torch.stack([F.pad(tree.extra[0], (0, 1), value=-1), F.pad(tree.extra[0], (1, 0), value=9)])
    block = Block(tree.tokens.expand(2, 3), tree.pos.expand(2, 3), tree.slots, torch.tensor([[5] * 3, [2] * 3]), extra)
    for tail in (1, 2, 16):  # all but itself read in place; a root's and its child's keys gathered; all gathered
        ctx = context(model, block, 10, True, tail=tail)
        for b, keys in enumerate([[list(range(5)) + p for p in paths], [[0, 1, 9] + p for p in paths]]):
            for t, canonical in enumerate(keys):
                assert keys_in_order(ctx, b, t) == canonical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(args=model_args(), seed=st.integers(0, 2**16), T=st.integers(16, 48))
def test_exact_rows_do_not_depend_on_their_index(device, dtype, args, seed, T):
    """Exact mode's premise: permuting a block's rows permutes their logits, bitwise.

    Each row sees only itself, so its result depends on its token and position alone. This
    caught CPU elementwise kernels finishing a block's last elements on a scalar path. Blocks
    have at least 16 rows, as the engine's do: MKL computes the last rows of a GEMM with 5-11
    rows on another path.
    """
    rows_by_index(random_model(args, seed, dtype, device), seed, T, device)
