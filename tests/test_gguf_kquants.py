"""The reference packer (`lmstack.testing.gguf_quants`) against the gguf package's dequantization
(written from llama.cpp's, the oracle for every type): blocks decode to exactly the values the
packer meant, those values are close to the input, and the writer's K-quant files hold the
types asked for (Q4_K_M's mix, llama.cpp's fallbacks for rows that are not whole blocks).
Also the resident-bytes counter `lmstack check --memory` and quant_cpu.py share."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from lmstack.model.memory import resident_weight_bytes
from lmstack.testing.gguf_quants import TYPES, quantize, quantize_meant

# Relative RMS error of a round trip on Gaussian rows with this simple scale choice (measured
# 0.33 / 0.18 / 0.077 / 0.038 / 0.022 / 0.044 / 0.038 / 0.085), with headroom.
RMS_BOUND = {
    T.Q2_K: 0.4,
    T.Q3_K: 0.22,
    T.Q4_K: 0.1,
    T.Q5_K: 0.05,
    T.Q6_K: 0.03,
    T.Q5_0: 0.06,
    T.Q5_1: 0.05,
    T.IQ4_NL: 0.1,
}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_decode_to_what_the_packer_meant(qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((7, 512)).astype(np.float32) * rng.uniform(0.01, 5.0, (7, 1)).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block: zero scales
    x[1] = np.abs(x[1])  # no negative values (the affine types' min is 0)
    x[2] = -np.abs(x[2])  # no positive values
    blocks, meant = quantize_meant(x, qtype)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (7, 512 // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1])
    decoded = gguf.quants.dequantize(blocks, qtype).reshape(x.shape)
    np.testing.assert_array_equal(decoded, meant)
    assert not decoded[0, :256].any()
    rms = np.sqrt(((decoded - x) ** 2).mean(1) / (x**2).mean(1))[1:]
    assert rms.max() < RMS_BOUND[qtype], rms
    assert rms.max() > 0.001  # it was rounded at all


def test_packer_refuses_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 576), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="no reference packer"):
        quantize(np.zeros((2, 256), np.float32), T.IQ2_XS)


def test_writer_writes_q4_k_m_and_falls_back_as_llama_cpp(tmp_path) -> None:
    from lmstack.model.gguf_file import read_gguf
    from lmstack.testing.gguf_writer import write_gguf
    from lmstack.testing.tiny_gemma import write_tiny_gemma

    # Gemma's tiny default widths (hidden 64, MLP 96) are not whole super-blocks: Q4_K falls back
    # to Q5_0 (whole 32-blocks), as llama-quantize does.
    small = write_tiny_gemma(3, tmp_path / "small")
    types = {
        n: t.ggml_type.name
        for n, t in read_gguf(write_gguf(small, tmp_path / "s.gguf", tensor_type="q4_k")).tensors.items()
    }
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down.weight"] == "Q5_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    wide = write_tiny_gemma(3, tmp_path / "wide", hidden_size=256, intermediate_size=512, head_dim=64)
    file = read_gguf(write_gguf(wide, tmp_path / "w.gguf", tensor_type="q4_k_m"))
    types = {n: t.ggml_type.name for n, t in file.tensors.items()}
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == types["output.weight"] == "Q6_K"
    assert (
        types["blk.0.attn_q.weight"]
        == types["blk.0.attn_output.weight"]
        == types["token_embd.weight"]
        == "Q4_K"
    )
    w = file.tensors["blk.0.attn_q.weight"]
    assert w.shape == (256, 256)
    torch.testing.assert_close(
        torch.from_numpy(gguf.quants.dequantize(w.data, T.Q4_K)),
        _folder_tensor(wide, "model.layers.0.self_attn.q_proj.weight"),
        atol=0.5,
        rtol=0.1,
    )


def _folder_tensor(folder, name: str) -> torch.Tensor:
    from lmstack.model.hf_loader import iter_safetensors

    return dict(iter_safetensors(folder))[name].float()


def test_resident_weight_bytes_counts_each_storage_once() -> None:
    from torch import nn

    class Holder:
        def __init__(self, t: torch.Tensor) -> None:
            self.copy = t

    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.Embedding(4, 8))
    model[0].kernel = Holder(torch.zeros(10, dtype=torch.uint8))  # a kernel's re-laid copy
    model[0].view = model[0].weight.data[:2]  # a view: the same storage
    assert resident_weight_bytes(model) == 4 * 8 * 4 + 4 * 8 * 4 + 10
    tied = nn.Sequential(nn.Embedding(4, 8), nn.Linear(8, 4, bias=False))
    tied[1].weight = tied[0].weight
    assert resident_weight_bytes(tied) == 4 * 8 * 4
