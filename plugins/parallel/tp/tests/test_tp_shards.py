"""What each tensor-parallel rank holds: built in one process with explicit ranks (no process
group is needed to build and load a shard), compared against the whole checkpoint tensors."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from lmstack.exec.distributed import ParallelRanks
from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import GGUFTensor
from lmstack.model.hf_loader import iter_safetensors, parse_llama_config, read_json
from lmstack.model.linear import default_linear
from lmstack.model.llama import LlamaModel
from lmstack.model.tensor_parallel import attention_shard, valid_tp_degrees


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    cfg = parse_llama_config(read_json(tiny_model_path / "config.json"), "tiny")
    return cfg, dict(iter_safetensors(tiny_model_path))


def _shard(cfg, weights, tp: int, rank: int) -> LlamaModel:
    model = LlamaModel(cfg, ranks=ParallelRanks(tp=tp, rank=rank))
    model.load_weights(weights.items())
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_split_kv_heads_and_vocab_padding_tp2(tiny, rank):
    cfg, w = tiny
    d, hq, hkv = cfg.head_dim, cfg.num_heads // 2, cfg.num_kv_heads // 2
    m = _shard(cfg, w, 2, rank)
    layer = m.layers[0]
    q, k, v = (w[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    want = torch.cat(
        [
            q[rank * hq * d : (rank + 1) * hq * d],
            k[rank * hkv * d : (rank + 1) * hkv * d],
            v[rank * hkv * d : (rank + 1) * hkv * d],
        ]
    )
    assert torch.equal(layer.qkv_proj.weight, want)
    o = w["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(layer.o_proj.weight, o[:, rank * hq * d : (rank + 1) * hq * d])
    inter = cfg.intermediate_size // 2
    gate, up = w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]
    rows = slice(rank * inter, (rank + 1) * inter)
    assert torch.equal(layer.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]))
    down = w["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(layer.down_proj.weight, down[:, rows])
    assert m.local_num_kv_heads == hkv and layer.num_heads == hq
    # Vocabulary: ceil(V / 2) rows per rank, the last shard zero-padded.
    vocab, local = cfg.vocab_size, -(-cfg.vocab_size // 2)
    assert vocab % 2 == 1, "the tiny vocabulary is odd, so the last shard is padded"
    emb = w["model.embed_tokens.weight"]
    got = m.embed_tokens.weight
    assert got.shape == (local, cfg.hidden_size)
    real = min(local, vocab - rank * local)
    assert torch.equal(got[:real], emb[rank * local : rank * local + real])
    assert not got[real:].any()
    head = w.get("lm_head.weight", emb)
    assert torch.equal(m.lm_head.weight[:real], head[rank * local : rank * local + real])


def test_kv_heads_replicated_when_tp_exceeds_them(tiny):
    cfg, w = tiny
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    d = cfg.head_dim
    k = w["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(4):
        layer = _shard(cfg, w, 4, rank).layers[0]
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        kv_head = rank // 2  # query heads 2r and 2r+1 share KV head r; rank r holds query head r
        got_k = layer.qkv_proj.weight[d : 2 * d]
        assert torch.equal(got_k, k[kv_head * d : (kv_head + 1) * d])


def test_head_split_rule():
    assert (attention_shard(9, 3, 3).num_heads, attention_shard(9, 3, 3).num_kv_heads) == (3, 1)
    assert attention_shard(8, 2, 4).kv_replicas == 2
    with pytest.raises(ValueError, match="9 query heads"):
        attention_shard(9, 3, 2)
    with pytest.raises(ValueError, match="KV heads"):
        attention_shard(12, 4, 6)  # 6 neither divides 4 nor is a multiple of it


def test_row_parallel_bias_on_rank_zero_only():
    bias = torch.arange(6, dtype=torch.float32)
    weight = torch.randn(6, 8)
    for rank in (0, 1):
        layer = default_linear(LinearSpec(8, 6, True, "o", parallel="row", tp_rank=rank, tp_size=2))
        layer.bias.weight_loader(layer.bias, bias, None)
        layer.weight.weight_loader(layer.weight, weight, None)
        assert torch.equal(layer.bias, bias if rank == 0 else torch.zeros(6))
        assert torch.equal(layer.weight, weight[:, rank * 4 : (rank + 1) * 4])


def test_gguf_packed_rows_are_cut_before_decoding():
    """A column shard of packed Q8_0 data is its rows, still packed; a row shard decodes then cuts."""
    dense = torch.randn(8, 64)
    packed = quantize(dense.numpy(), GGMLQuantizationType.Q8_0)
    t = GGUFTensor(data=packed, ggml_type=GGMLQuantizationType.Q8_0, shape=(8, 64))
    whole = t.dequantize()
    col = default_linear(LinearSpec(64, 8, False, "c", (4, 4), "column", tp_rank=1, tp_size=2))
    col.weight.weight_loader(col.weight, t.take_rows(slice(0, 4)), 0)
    col.weight.weight_loader(col.weight, t.take_rows(slice(4, 8)), 1)
    assert torch.equal(col.weight, torch.cat([whole[2:4], whole[6:8]]))
    # Row shards: 32 columns are one Q8_0 block per row (cut packed); 16 are not (decoded whole).
    for tp, rank in ((2, 1), (4, 2)):
        row = default_linear(LinearSpec(64, 8, False, "r", parallel="row", tp_rank=rank, tp_size=tp))
        row.weight.weight_loader(row.weight, t, None)
        width = 64 // tp
        assert torch.equal(row.weight, whole[:, rank * width : (rank + 1) * width])
    f32 = GGUFTensor(data=dense.numpy(), ggml_type=GGMLQuantizationType.F32, shape=(8, 64))
    row = default_linear(LinearSpec(64, 8, False, "r", parallel="row", tp_rank=1, tp_size=2))
    row.weight.weight_loader(row.weight, f32, None)
    assert torch.equal(row.weight, dense[:, 32:])


def test_valid_degrees_of_the_tiny_model(tiny):
    cfg, _ = tiny
    assert valid_tp_degrees(cfg) == [1, 2, 4]
