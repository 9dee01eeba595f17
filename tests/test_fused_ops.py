"""The in-place / fused reference ops are bit-identical to the plain formulas they replace (the
native CPU layer ops are tested against them in test_layer_ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmstack.model import layer_ops
from lmstack.model.layer_ops import silu_mul
from lmstack.model.llama import RMSNorm
from lmstack.model.rope import RotaryEmbedding, rotate, rotate_

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_and_fused_residual_match_the_formula(dtype, rows, monkeypatch):
    monkeypatch.setattr(layer_ops, "native", lambda: None)  # the torch reference ops
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype)
    x0, res0 = x.clone(), res.clone()
    assert torch.equal(norm(x), _plain_rms_norm(x0, norm.weight, 1e-5))
    assert torch.equal(x, x0)  # without a residual the input is left alone
    out, stream = norm(x, res)
    assert torch.equal(stream, res0 + x0)
    assert torch.equal(out, _plain_rms_norm(res0 + x0, norm.weight, 1e-5))
    assert torch.equal(res, res0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotate_in_place_on_a_strided_view_matches_rotate(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 6, 2, 16
    rope = RotaryEmbedding(d, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    positions = torch.randint(0, 64, (tokens,), generator=g)
    # A fused qkv row: Q and K heads rotate in place, V stays as it is.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    qk_size = (heads + kv_heads) * d
    expected = rotate(qkv[:, :qk_size].reshape(tokens, -1, d), *rope.tables(positions, dtype))
    v = qkv[:, qk_size:].clone()
    out = rotate_(qkv[:, :qk_size].view(tokens, -1, d), *rope.tables_full(positions, dtype))
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, :qk_size].view(tokens, -1, d), expected)
    assert torch.equal(qkv[:, qk_size:], v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_silu_times_up(dtype, monkeypatch):
    monkeypatch.setattr(layer_ops, "native", lambda: None)  # the torch reference ops
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    assert torch.equal(silu_mul(gate_up), F.silu(gate) * up)
