"""int8 rows against plain torch: the quantization itself, and every matmul path of the layer
(the op in bf16, the op for fp32 activations, dequantize + matmul, slabs) against the
dequantized weight times x, on fresh random shapes each run (odd sizes included)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import GGUFTensor
from lmstack_int8 import kernel
from lmstack_int8.head import Int8Embedding, quantize_embedding_and_head
from lmstack_int8.kernel import FP32_DEQUANT_MIN_ROWS, NATIVE_MAX_ROWS, Int8Matmul, quantize_rows
from lmstack_int8.linear import Int8Linear


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def test_quantize_rows_is_symmetric_per_row_within_half_a_step():
    rng = random.Random()
    for _ in range(5):
        n, k = rng.randint(1, 70), rng.randint(1, 300)
        w = torch.randn(n, k) * rng.choice((1e-3, 1.0, 40.0))
        w[rng.randrange(n)] = 0.0  # an all-zero row
        q, scale = quantize_rows(w)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32
        assert q.abs().max() <= 127
        amax = w.abs().amax(dim=1)
        nonzero = amax > 0
        # max|w| / 127 rounded up to a bf16 value: at most one bf16 step (2^-8) larger.
        assert torch.all(scale[nonzero] >= amax[nonzero] / 127)
        assert torch.all(scale[nonzero] <= amax[nonzero] / 127 * (1 + 2**-7))
        assert torch.equal(scale.to(torch.bfloat16).float(), scale)
        err = (w - q.float() * scale[:, None]).abs()
        assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-6))
        assert torch.all(q[~nonzero] == 0)


def _layer(
    rng: random.Random, dtype: torch.dtype, exact: bool, k: int | None = None, use_native: bool = True
):
    k = k or rng.choice((rng.randint(1, 200), 16 * rng.randint(1, 12)))
    sizes = tuple(rng.randint(1, 70) for _ in range(rng.choice((1, 2, 3))))
    bias = rng.random() < 0.5
    spec = LinearSpec(k, sum(sizes), bias, "layers.0.test_proj", sizes, "column", dtype)
    layer = Int8Linear(spec, exact_fp32=exact, use_native=use_native)
    weights = [torch.randn(s, k) for s in sizes]
    for i, w in enumerate(weights):
        layer.weight.weight_loader(layer.weight, w, i if len(sizes) > 1 else None)
    b = torch.randn(sum(sizes)) if bias else None
    if bias:
        for i, part in enumerate(b.split(sizes)):
            layer.bias.weight_loader(layer.bias, part, i if len(sizes) > 1 else None)
    return layer, torch.cat(weights), b


def _reference(
    layer: Int8Linear,
    x: torch.Tensor,
    b: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain torch: x @ (q * scale)^T computed in fp32 from the layer's own int8 values (the
    weight rounded to `weight_dtype`), rounded to `dtype`, then + b in `dtype` (where a
    kernel's output is rounded)."""
    w = (layer.weight.float() * layer.weight_scale[:, None]).to(weight_dtype).float()
    out = (x.float() @ w.T).to(dtype)
    return out if b is None else out + b.to(dtype)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch-ops"])
@pytest.mark.parametrize("exact", [False, True])
def test_fp32_layer_matches_dequantized_reference(exact, use_native):
    rng = random.Random()
    for _ in range(6):
        layer, w, b = _layer(rng, torch.float32, exact, use_native=use_native)
        # Decode-sized and prefill-sized batches: the C++ kernel or the op (in bf16) below the
        # thresholds, dequantize + matmul above.
        for m in (
            rng.randint(1, FP32_DEQUANT_MIN_ROWS - 1),
            rng.randint(FP32_DEQUANT_MIN_ROWS, NATIVE_MAX_ROWS),
            rng.randint(NATIVE_MAX_ROWS + 1, 80),
        ):
            x = torch.randn(m, layer.in_features)
            with torch.no_grad():
                out = layer(x)
            assert out.dtype == torch.float32 and out.shape == (m, layer.out_features)
            path = layer.matmul.path(x, layer.weight)
            if path in ("op-bf16", "dequant-bf16"):
                # The activations rounded to bf16, the product too (the op's dtype), the bias
                # added in fp32; results may differ by one bf16 step where fp32 sums differ.
                # dequant-bf16 rounds the weight to bf16 as well (q * scale has up to 15 bits).
                wdt = torch.bfloat16 if path == "dequant-bf16" else torch.float32
                ref = _reference(layer, x.to(torch.bfloat16), None, torch.bfloat16, wdt).float()
                ref = ref if b is None else ref + b
                bound = torch.finfo(torch.bfloat16).eps / 8
            elif path == "native":
                ref, bound = _reference(layer, x, b), 1e-6  # fp32 throughout, sums in another order
            else:
                assert path == "dequant", path
                ref, bound = _reference(layer, x, b), 1e-6
            assert _rel(out, ref) <= bound, f"{path} k={layer.in_features} m={m}: {_rel(out, ref):.2e}"
            # ... and the int8 weight is the loaded one to within its rounding: per output, at
            # most sum |x| * scale / 2 (each weight within half a step), plus, where x and the
            # product are rounded to bf16, a bf16 step of |x| @ |w| each. (A relative bound over
            # the whole output fails now and then: two outputs that nearly cancel.)
            exact_out = x @ w.T + (0 if b is None else b)
            limit = x.abs().sum(-1, keepdim=True) * layer.weight_scale / 2
            if path in ("op-bf16", "dequant-bf16"):
                limit = limit + 2 * torch.finfo(torch.bfloat16).eps * (x.abs() @ w.abs().T)
            assert torch.all((out - exact_out).abs() <= limit * (1 + 1e-4) + 1e-5), path


@pytest.mark.parametrize("native_bf16", [False, True], ids=["fp32-cpu", "native-bf16-cpu"])
def test_fp32_paths_are_chosen_as_documented(native_bf16, monkeypatch):
    monkeypatch.setattr(kernel, "native_bf16_cpu", lambda: native_bf16)
    big = "dequant-bf16" if native_bf16 and kernel.has_int8pack_op() else "dequant"
    rng = random.Random()
    layer, _, _ = _layer(rng, torch.float32, False, k=64)
    if kernel.native_kernel() is not None:
        for m in (1, NATIVE_MAX_ROWS):
            assert layer.matmul.path(torch.randn(m, 64), layer.weight) == "native"
            assert Int8Matmul(exact_fp32=True).path(torch.randn(m, 64), layer.weight) == "native"
        assert layer.matmul.path(torch.randn(NATIVE_MAX_ROWS + 1, 64), layer.weight) == big
        assert (
            Int8Matmul(exact_fp32=True).path(torch.randn(NATIVE_MAX_ROWS + 1, 64), layer.weight) == "dequant"
        )
        assert layer.matmul.path(torch.randn(2, 64, dtype=torch.bfloat16), layer.weight) != "native"
    layer, _, _ = _layer(rng, torch.float32, False, k=64, use_native=False)
    small, large = torch.randn(FP32_DEQUANT_MIN_ROWS - 1, 64), torch.randn(FP32_DEQUANT_MIN_ROWS, 64)
    expect_op = "op-bf16" if kernel.has_int8pack_op() else "dequant"
    assert layer.matmul.path(small, layer.weight) == expect_op
    assert layer.matmul.path(large, layer.weight) == big
    assert Int8Matmul(exact_fp32=True, use_native=False).path(small, layer.weight) == "dequant"
    odd, _, _ = _layer(rng, torch.float32, False, k=37, use_native=False)  # the op needs K % 16 == 0
    assert odd.matmul.path(torch.randn(2, 37), odd.weight) == "dequant"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_layers_match_dequantized_reference(dtype):
    rng = random.Random()
    for _ in range(6):
        layer, _, b = _layer(rng, dtype, False)
        x = torch.randn(rng.randint(1, 40), layer.in_features).to(dtype)
        with torch.no_grad():
            out = layer(x)
        assert out.dtype == dtype
        # The op multiplies by the exact weight; dequantize + matmul by the weight rounded to
        # `dtype`. Both round the product, then the bias sum, to `dtype`: they differ from the
        # reference by a step only where fp32 sums (in other orders) straddle a boundary.
        path = layer.matmul.path(x, layer.weight)
        ref = _reference(layer, x, b, dtype, torch.float32 if path == "op" else dtype)
        bound = torch.finfo(dtype).eps / 8
        assert _rel(out, ref) <= bound, f"{dtype} k={layer.in_features}: {_rel(out, ref):.2e}"


def test_dequant_slabs_cover_every_row(monkeypatch):
    """A weight larger than a slab is rebuilt in several, the last one partial."""
    rng = random.Random()
    n, k = rng.randint(50, 90), rng.randint(3, 40)
    monkeypatch.setattr(kernel, "SLAB_BYTES", 4 * k * rng.randint(7, 13))
    q, scale = quantize_rows(torch.randn(n, k))
    x = torch.randn(rng.randint(1, 5), k)
    out = kernel.dequant_matmul(x, q, scale)
    ref = x @ (q.float() * scale[:, None]).T
    assert _rel(out, ref) <= 1e-6


def test_a_whole_fused_tensor_loads_like_its_parts():
    rng = random.Random()
    sizes, k = (rng.randint(1, 30), rng.randint(1, 30)), rng.randint(1, 50)
    w = torch.randn(sum(sizes), k)
    spec = LinearSpec(k, sum(sizes), False, "layers.0.gate_up_proj", sizes, "column")
    whole, parts = Int8Linear(spec), Int8Linear(spec)
    whole.weight.weight_loader(whole.weight, w, None)
    for i, part in enumerate(w.split(sizes)):
        parts.weight.weight_loader(parts.weight, part, i)
    assert torch.equal(whole.weight, parts.weight) and torch.equal(whole.weight_scale, parts.weight_scale)


def test_gguf_rows_quantize_like_their_dense_values():
    """A packed GGUF tensor (Q8_0) is decoded per rank's rows, then quantized per row."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    n, k = 24, 64
    packed = quantize(np.random.randn(n, k).astype(np.float32), GGMLQuantizationType.Q8_0)
    tensor = GGUFTensor(packed, GGMLQuantizationType.Q8_0, (n, k))
    dense = torch.from_numpy(dequantize(packed, GGMLQuantizationType.Q8_0).copy())
    for rank in range(2):
        spec = LinearSpec(k, n, False, "layers.0.o_proj", (n,), "column", tp_rank=rank, tp_size=2)
        layer = Int8Linear(spec)
        layer.weight.weight_loader(layer.weight, tensor, None)
        q, scale = quantize_rows(dense[rank * n // 2 : (rank + 1) * n // 2])
        assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)


class _TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_and_head_become_int8_rows(tied):
    rng = random.Random()
    vocab, hidden = rng.randint(20, 90), 16 * rng.randint(1, 4)
    model = _TinyLM(vocab, hidden, tied)
    embed_w, head_w = model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    assert quantize_embedding_and_head(model, exact_fp32=False) == ["embed_tokens", "lm_head"]
    assert isinstance(model.embed_tokens, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    assert (model.lm_head is model.embed_tokens.table) == tied  # one int8 copy when tied
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(5)]])
    table = model.embed_tokens.table
    got = model.embed_tokens(ids)
    assert got.shape == (1, 5, hidden) and got.dtype == torch.float32
    want = (table.weight.float() * table.weight_scale[:, None])[ids]
    assert torch.equal(got, want)
    assert _rel(got, embed_w[ids]) <= 0.02
    x = torch.randn(3, hidden)
    assert _rel(model.lm_head(x), x @ head_w.T) <= 0.03
    assert not any(p.dtype.is_floating_point and p.numel() >= vocab * hidden for p in model.parameters())


@pytest.mark.skipif(kernel.native_kernel() is None, reason="the C++ kernel did not build here")
@pytest.mark.parametrize("native_bf16", [False, True], ids=["fp32-cpu", "native-bf16-cpu"])
def test_int8_activation_row_limit_follows_what_takes_the_batches_above(native_bf16, monkeypatch):
    """Above the kernel's row limit a native-bf16 CPU multiplies in bf16 (dequant-bf16), which
    overtakes the int8-activation kernel sooner than the fp32 matmul does elsewhere."""
    monkeypatch.setattr(kernel, "native_bf16_cpu", lambda: native_bf16)
    matmul = Int8Matmul(use_native=True, int8_activations=True)
    want = kernel.INT8_ACT_MAX_ROWS_NATIVE_BF16 if native_bf16 else kernel.INT8_ACT_MAX_ROWS
    assert matmul.native_max_rows(64) == want and matmul.native_max_rows(48) == NATIVE_MAX_ROWS
    assert Int8Matmul(use_native=True, int8_activations=False).native_max_rows(64) == NATIVE_MAX_ROWS


def test_int8_activations_take_the_rounding_kernel_where_k_allows():
    """`activations: int8`: a layer whose K is whole 32-blocks multiplies decode rows through
    `int8_matmul_q8` (the same bits, by the direct path and through `Int8Matmul`, with a bias,
    for a 3-D batch, and the tied head), one whose K is not keeps the fp32 kernel; batches above
    the kernel's row limit (with int8 activations `INT8_ACT_MAX_ROWS`, or `..._NATIVE_BF16` on
    such a CPU; else `NATIVE_MAX_ROWS`) keep the dequantized matmul."""
    ext = kernel.native_kernel()
    for k, fn in ((64, ext.int8_matmul_q8), (37, ext.int8_matmul)):
        for bias in (False, True):
            spec = LinearSpec(k, 45, bias, "layers.0.test_proj", (45,), "column", torch.float32)
            layer = Int8Linear(spec, use_native=True, int8_activations=True)
            layer.weight.weight_loader(layer.weight, torch.randn(45, k), None)
            if bias:
                layer.bias.weight_loader(layer.bias, torch.randn(45), None)
            x = torch.randn(3, k)
            want = fn(x, layer.weight.data, layer.weight_scale)
            if bias:
                want = want + layer.bias
            assert torch.equal(layer(x), want), (k, bias)
            assert torch.equal(layer(x.reshape(3, 1, k)).reshape(3, 45), want), (k, bias)
            most = layer.matmul.native_max_rows(k)
            int8_most = (
                kernel.INT8_ACT_MAX_ROWS_NATIVE_BF16 if kernel.native_bf16_cpu() else kernel.INT8_ACT_MAX_ROWS
            )
            assert most == (int8_most if k == 64 else NATIVE_MAX_ROWS)
            edge = torch.randn(most, k)
            want = fn(edge, layer.weight.data, layer.weight_scale)
            assert torch.equal(layer(edge), want if not bias else want + layer.bias), (k, bias)
            big = torch.randn(most + 1, k)
            path = layer.matmul.path(big, layer.weight)
            if path == "dequant-bf16":  # a CPU with native bf16: x and the weight rounded to bf16
                ref = _reference(layer, big.to(torch.bfloat16), None, torch.bfloat16, torch.bfloat16).float()
                ref, bound = ref + (layer.bias if bias else 0), torch.finfo(torch.bfloat16).eps / 8
            else:
                assert path == "dequant", path
                ref, bound = _reference(layer, big, layer.bias), 1e-5
            assert _rel(layer(big), ref) < bound, (k, bias, path)
    model = nn.Module()
    model.embed_tokens, model.lm_head = nn.Embedding(70, 96), None
    model.lm_head = nn.Linear(96, 70, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    quantize_embedding_and_head(model, exact_fp32=False, use_native=True, int8_activations=True)
    h = torch.randn(2, 96)
    table = model.lm_head
    assert torch.equal(table(h), ext.int8_matmul_q8(h, table.weight.data, table.weight_scale))
