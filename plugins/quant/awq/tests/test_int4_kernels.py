"""The int4 kernels against the dequantized reference: the Triton W4A16 kernel in the Triton
interpreter (fresh random shapes, odd sizes, partial last groups), the CPU int4pack kernel, and
the int4pack layout's row gather used by the int4 embedding."""

from __future__ import annotations

import random

import pytest
import torch

from lmstack.interfaces import LinearSpec
from lmstack.testing.attention import rel_error
from lmstack_awq import kernels
from lmstack_awq.int4_math import Int4Scheme, pack_nibbles, quantize_int4
from lmstack_awq.kernels import gguf_blocks
from lmstack_awq.kernels.cpu_int4pack import FP32_DEQUANT_MIN_ROWS, PROBE_ROWS, CpuInt4Pack, PackedLayout
from lmstack_awq.kernels.gguf_blocks import GGUFBlocks
from lmstack_awq.linear import Int4Linear


def _layer(out: int, k: int, group: int, symmetric: bool = False) -> tuple[Int4Linear, torch.Tensor]:
    w = torch.randn(out, k) * k**-0.5
    layer = Int4Linear(LinearSpec(k, out, False, "kit"), Int4Scheme(group, symmetric), "dense")
    layer.weight.weight_loader(layer.weight, w, None)
    return layer, quantize_int4(w, Int4Scheme(group, symmetric)).dequantize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_w4a16_matches_dequantized_reference(dtype):
    from lmstack_awq.kernels.triton_w4a16 import GemmConfig, w4a16_dequantize, w4a16_gemm, w4a16_matmul

    rng = random.Random()
    # 576 = 4.5 groups of 128 (SmolLM2's hidden size); the rest are fresh and odd.
    shapes = [
        (1, 40, 576, 128),
        (rng.randint(1, 40), rng.randint(1, 90), rng.randint(1, 200), rng.choice((32, 64, 128))),
    ]
    for m, n, k, group in shapes:
        layer, w = _layer(n, k, group, symmetric=rng.random() < 0.5)
        x = torch.randn(m, k)
        ref = x @ w.t()
        plain = (x.to(dtype) @ w.to(dtype).t()).float()
        bound = 2 * rel_error(plain, ref) + torch.finfo(dtype).eps + 1e-6
        args = (x.to(dtype), layer.w_packed, layer.w_scales, layer.w_zeros, k, group)
        # The chosen path, the dequantize-then-matmul path (tiles of 128 columns: one scale per
        # row only for groups of 128; of 32: for every group here), and the GEMM with split K and
        # with steps of 32 columns (one scale per step where the group allows, else per column).
        outs = {
            "default": w4a16_matmul(*args, interpret=True),
            "dequant": w4a16_matmul(*args, interpret=True, dequant_min_rows=1),
            "dequant, 32-column tiles": x.to(dtype) @ w4a16_dequantize(*args[1:], dtype, (16, 16)).t(),
            "split": w4a16_gemm(*args, GemmConfig(16, 16, 16, split_k=3), interpret=True),
        }
        for name, out in outs.items():
            assert out.dtype == dtype and out.shape == (m, n), name
            assert rel_error(out.float(), ref) <= bound, f"{name} {(m, n, k, group)} {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4pack_matches_reference_and_gives_codes_back(dtype):
    layer, w = _layer(96, 576, 128)
    assert CpuInt4Pack.supports(layer)
    codes = layer.codes().clone()
    layer.kernel = CpuInt4Pack(layer)  # fp32 layers would take the GGUF blocks where built
    # A few rows run the op in bf16 (fp32 activations rounded to bf16: the op's fp32 path is
    # slow); from FP32_DEQUANT_MIN_ROWS rows fp32 is exact (decoded weight, dense matmul).
    for rows in (7, FP32_DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 576)
        out = layer(x.to(dtype))
        assert isinstance(layer.kernel, CpuInt4Pack) and out.dtype == dtype
        ref = x @ w.t()
        compute = torch.bfloat16 if rows < FP32_DEQUANT_MIN_ROWS else dtype
        plain = (x.to(compute) @ w.to(compute).t()).float()
        bound = 2 * rel_error(plain, ref) + torch.finfo(compute).eps + 1e-6
        assert rel_error(out.float(), ref) <= bound, (rows, dtype)
    if dtype == torch.float32:  # fp32_activations: exact
        layer.exact_fp32 = True
        x = torch.randn(3, 576)
        ref = x @ w.t()
        assert rel_error(layer(x), ref) <= 2 * rel_error(x @ w.t(), ref) + 1e-6
        layer.exact_fp32 = False
    assert torch.equal(layer.codes(), codes)  # recovered from the re-laid buffer
    ids = torch.tensor([0, 95, 31, 32, 64, 7])
    assert torch.equal(layer.row_codes(ids), codes[ids])
    # One (scale, offset) table beside the codes, in the dtype the op multiplies in (bf16 for
    # this fp32 layer); a call in another half dtype computes its own and keeps nothing.
    held = [v for v in vars(layer.kernel).values() if isinstance(v, torch.Tensor)]
    assert [(t.dtype, t.shape) for t in held] == [(torch.bfloat16, (576 // 64, 96, 2))]
    x = torch.randn(5, 576)
    out = layer(x.half())
    assert out.dtype == torch.float16
    assert (
        rel_error(out.float(), x @ w.t())
        <= 2 * rel_error((x.half() @ w.half().t()).float(), x @ w.t()) + 2e-3
    )
    assert [v for v in vars(layer.kernel).values() if isinstance(v, torch.Tensor)] == held


def _is_int8_rounded_x_times_blocks(out: torch.Tensor, x: torch.Tensor, layer) -> bool:
    """out = (x rounded per 32 values as the int8-activation kernels document: dx = max|x| / 127,
    round-half-even(x / dx) * dx) @ (the layer's Q4_1 blocks dequantized)^T, up to fp32 sums."""

    xb = x.reshape(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = (torch.round(xb * inv) * dx).reshape(x.shape).double()
    wb = layer.kernel.dequantized(layer).double()
    mag = xq.abs() @ wb.abs().t()
    return bool(
        torch.all((out.double() - xq @ wb.t()).abs() <= 8 * (layer.in_features + 4) * 2**-24 * mag + 1e-30)
    )


@pytest.mark.skipif(not gguf_blocks.available(), reason="lmstack-gguf's kernels are not built here")
@pytest.mark.parametrize("symmetric", [False, True])
def test_gguf_blocks_match_the_dequantized_layer_and_give_codes_back(symmetric):
    """fp32 layers take lmstack-gguf's Q4_1 kernel (groups of 32) or its Q4_1G one (one header per
    group of 64 or 128): d = scale exactly, m = -zero * scale rounded once to fp16, so the result is
    the dequantized weight's up to that rounding and fp32 sums. The blocks replace the nibbles and
    the separate scales and zeros: the layer holds the blocks' bytes and nothing else."""
    from lmstack_gguf.api import dequantize_blocks, native_kernel

    rng = random.Random()
    n, k, group = rng.randint(1, 70), 32 * rng.randint(1, 20), rng.choice((32, 64, 128))
    layer, w = _layer(n, k, group, symmetric)
    codes = layer.codes().clone()
    layer.prepare()  # picks the kernel for the serving dtype (fp32), which re-lays the weight
    kernel = layer.kernel
    assert isinstance(kernel, GGUFBlocks)
    assert kernel.type == {32: gguf_blocks.Q4_1, 64: 1001, 128: 1002}[group]
    assert layer.w_packed.shape == (n, native_kernel().row_bytes(kernel.type, k))
    assert layer.w_scales.numel() == layer.w_zeros.numel() == 0 and kernel.dense is None
    for rows in (1, rng.randint(2, 32), rng.randint(33, 80)):  # the kernel, then the rebuilt layer
        x = torch.randn(rows, k)
        ref = x.double() @ w.double().t()
        mag = (
            x.abs().double() @ w.abs().double().t()
            + x.abs().double().sum(-1, keepdim=True) * 2**-12 * w.abs().max()
        )
        # Over the kernel's rows a native-bf16 CPU multiplies in bf16 (x and W rounded to it).
        eps = 2**-8 if rows > kernel.max_rows and kernel.bf16 else 2**-11
        assert torch.all((layer(x).double() - ref).abs() <= eps * 16 * mag + 1e-6), rows
        out16 = layer(x.to(torch.bfloat16))
        assert out16.dtype == torch.bfloat16
    assert torch.equal(layer.codes(), codes)
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(layer.row_codes(ids), codes[ids])
    # The embedding lookup of a tied int4 head: the rows of the blocks the matmul multiplies by,
    # the dequantized weight's up to m's fp16 rounding.
    rows = kernel.row_values(layer, ids, torch.float32)
    assert torch.equal(rows, dequantize_blocks(layer.w_packed, kernel.type, k)[ids])
    assert torch.equal(layer.dequantized_weight()[ids], rows)
    if k <= kernel.max_rows or not kernel.bf16:  # k rows through fp32 kernels
        assert torch.equal(rows, layer(torch.eye(k)).t()[ids])
    assert torch.all((rows - w[ids]).abs() <= 2**-12 * 15 * w.abs().max() + 1e-7)
    from lmstack_awq.compact import Int4Rows

    table = Int4Rows(torch.randn(n, k), group)
    assert torch.equal(
        table.rows(ids, torch.bfloat16), table.linear.kernel.row_values(table.linear, ids, torch.bfloat16)
    )
    # fp32_activations: int8: decode batches round x to int8 per 32 values (lmstack-gguf's q8 kernel).
    layer.int8_activations = True
    from lmstack_gguf.api import native_kernel

    x = torch.randn(rng.randint(1, layer.kernel.max_rows), k)  # the rows the kernel takes
    assert torch.equal(layer(x), native_kernel().gguf_matmul_q8(x, layer.w_packed, kernel.type))
    assert _is_int8_rounded_x_times_blocks(layer(x), x, layer)


@pytest.mark.skipif(not gguf_blocks.available(), reason="lmstack-gguf's kernels are not built here")
def test_bf16_copy_is_kept_only_when_asked_on_a_native_bf16_cpu():
    """`cpu_bf16_copy`: batches over 16 rows multiply by a bf16 copy of the layer (the blocks'
    values in bf16) where the CPU computes bf16 natively; elsewhere the option changes nothing."""
    from lmstack.kernels.hardware import native_bf16_cpu

    layer, _ = _layer(40, 128, 128)
    layer.bf16_copy = True
    layer.prepare()
    kernel = layer.kernel
    if not native_bf16_cpu():
        assert kernel.dense is None and kernel.max_rows == 32
        return
    assert kernel.max_rows == 16  # as without the copy (then rebuilt per call)
    assert torch.equal(kernel.dense, layer.dequantized_weight().to(torch.bfloat16))
    x = torch.randn(17, 128)
    assert torch.equal(layer(x), torch.nn.functional.linear(x.bfloat16(), kernel.dense).float())


@pytest.mark.skipif(not gguf_blocks.available(), reason="lmstack-gguf's kernels are not built here")
@pytest.mark.parametrize("int8_activations", [False, True])
def test_decode_rows_go_straight_to_the_gguf_op_with_the_kernels_result(int8_activations):
    """Decode rows skip the generic path (`Int4Kernel.direct`) and give exactly what the kernel
    object computes; a layer with a bias (bias-corrected AWQ folders) takes it too, the bias
    added after the op."""
    rng = random.Random()
    n, k = rng.randint(1, 70), 32 * rng.randint(1, 20)
    layer, _ = _layer(n, k, rng.choice((32, 64, 128)))
    layer.int8_activations = int8_activations
    layer.prepare()
    assert isinstance(layer.kernel, GGUFBlocks) and layer._direct is not None
    # max_rows 0: panels for every batch (int8 activations where AVX2 is the widest code).
    for rows in (1, rng.randint(2, layer.kernel.max_rows or 40)):
        x = torch.randn(rows, k)
        assert torch.equal(layer(x), layer.kernel(layer, x))
    layer.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    layer.kernel = layer.kernel  # set again: the fast path is decided with the kernel
    assert layer._direct is not None
    x = torch.randn(1, k)
    op, args = layer._direct[int8_activations]
    assert torch.equal(layer(x), op(x, *args) + layer.bias)
    assert torch.equal(layer(x), layer.kernel(layer, x) + layer.bias)


@pytest.mark.skipif(not gguf_blocks.available(), reason="lmstack-gguf's kernels are not built here")
@pytest.mark.parametrize("group", [32, 128])
def test_int8_activation_batches_take_panels_where_vnni_runs(group):
    """`fp32_activations: int8` set before the kernel is picked (as the quantizer does): wherever
    the panels run (AVX2 or AVX-512 VNNI) every batch multiplies by 16-row panels of the blocks
    (x rounded to int8 per 32 values, as the block kernel does), and the layer keeps only the
    panels: codes, rows and the dequantized weight come back from them unchanged."""
    from lmstack_gguf.api import layer_panels_min_rows, native_kernel, panels_cpu

    rng = random.Random()
    n, k = rng.randint(1, 70), 32 * rng.randint(1, 20)
    layer, w = _layer(n, k, group, False)
    codes = layer.codes().clone()
    reference, _ = _layer(n, k, group, False)  # the same layer with fp32 activations: blocks
    reference.load_state_dict(layer.state_dict())
    reference.prepare()
    layer.int8_activations = True
    layer.prepare()
    assert isinstance(layer.kernel, GGUFBlocks)
    ext = native_kernel()
    if not panels_cpu():
        assert layer.kernel.panels is None
        pytest.skip("this CPU lacks AVX2: the panels are not made")
    assert layer_panels_min_rows() == 1
    assert layer.kernel.dense is None and layer.kernel.max_rows == 0
    assert layer.kernel.panels_only and layer.w_packed.numel() == 0
    assert torch.equal(layer.codes(), codes)
    assert torch.equal(layer.dequantized_weight(), reference.dequantized_weight())
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(
        layer.kernel.row_values(layer, ids, torch.bfloat16),
        reference.kernel.row_values(reference, ids, torch.bfloat16),
    )
    big = torch.randn(rng.randint(1, 80), k)
    out = layer(big)
    assert torch.equal(out, ext.gguf_matmul_panels(big, layer.kernel.panels, layer.kernel.type, n))
    # A row's result is the same whatever batch it is in (panels sum rows alone).
    assert torch.equal(layer(big[:1]), out[:1])
    assert torch.equal(layer(big.bfloat16()), layer(big.bfloat16().float()).bfloat16())  # via fp32
    blocks = ext.gguf_matmul_q8(big, reference.w_packed, reference.kernel.type)
    assert float((out - blocks).abs().max()) <= 1e-5 * float(blocks.abs().max())
    assert _is_int8_rounded_x_times_blocks(out, big, layer)


def test_exact_fp32_and_half_layers_keep_torchs_int4_op():
    layer, _ = _layer(96, 576, 128)  # (select re-lays the weight: a fresh layer each time)
    layer.exact_fp32 = True
    assert isinstance(kernels.select(layer, torch.empty(0, 576)), CpuInt4Pack)
    layer, _ = _layer(96, 576, 128)
    assert isinstance(kernels.select(layer, torch.empty(0, 576, dtype=torch.bfloat16)), CpuInt4Pack)


@pytest.mark.parametrize("rows", [32, 96, 2 * PROBE_ROWS + 96, 3 * PROBE_ROWS + 32])
def test_packed_layout_finds_every_code(rows):
    """The layout learned from a probe (extrapolated past 2 * PROBE_ROWS rows) reads back any
    weight the op packed: whole, and row by row (the op's row blocks differ between AVX2 and
    AVX-512 builds of torch, and a row count that is not a multiple of them ends in a tail)."""
    k = random.choice((64, 96, 160))
    layout = PackedLayout(rows, k)
    q = torch.randint(0, 16, (rows, k), dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    assert torch.equal(layout.unpack(packed), q)
    ids = torch.tensor([0, rows - 1, rows // 2, 31, rows - 17, *random.sample(range(rows), 5)])
    nibbles = torch.stack((packed.view(-1) & 15, packed.view(-1) >> 4), dim=-1).view(-1)
    assert torch.equal(nibbles[layout.positions(ids)], q[ids])


def test_nibble_packing_is_compressed_tensors_byte_order():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(0, 16, (5, 37), dtype=torch.uint8)
    words = pack_to_int32((q.to(torch.int16) - 8).to(torch.int8), 4)
    assert torch.equal(words.view(torch.uint8), pack_nibbles(q))
