"""The GGUF block kernels against the gguf package's own (numpy) dequantization, each
implementation (AVX2+FMA+F16C where the CPU has it, plain C++), on fresh random blocks and
shapes each run: odd N, K of 1-20 blocks, M across the decode paths (1, several, > 16), rows of
x with a stride; the int8-activation path (x rounded per block, integer dot products) against the rounded x; the
exact Q8_0 rebuild; `GGUFLinear` loading fused parts, mixed encodings and a row-parallel split."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import GGUFTensor
from lmstack_gguf import kernel, native
from lmstack_gguf.linear import GGUFLinear

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
ext = None if native.load_error() else native.load()
needs_ext = pytest.mark.skipif(ext is None, reason=f"the kernels did not build: {native.load_error()}")


def blocks_of(w: np.ndarray, typ: T) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 block rows, their dequantized values in fp32) of a random fp32 matrix."""
    raw = np.ascontiguousarray(quants.quantize(w.astype(np.float32), typ))
    deq = quants.dequantize(raw, typ).reshape(w.shape).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(deq)


def within_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """out vs x @ w^T in float64: each output within a few fp32 ulps of the sum of magnitudes."""
    ref = x.double() @ w.double().T
    mag = x.abs().double() @ w.abs().double().T
    return bool(torch.all((out.double() - ref).abs() <= 8 * (k + 4) * 2**-24 * mag + 1e-30))


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_matmul_matches_the_dequantized_reference(typ, isa):
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    for m in (1, 2, rng.randint(3, 16), rng.randint(17, 40)):
        n, k = rng.choice((1, 2, 3)) * rng.randint(1, 40) + rng.randint(0, 1), 32 * rng.randint(1, 20)
        raw, w = blocks_of(np.random.randn(n, k) * rng.choice((1e-3, 1.0, 50.0)), typ)
        x = torch.randn(m, k + rng.randint(0, 5))[:, :k]  # rows with a stride
        out = ext.gguf_matmul(x, raw, int(typ), isa)
        assert out.shape == (m, n) and within_rounding(out, x, w, k), (
            f"{typ.name} isa {isa} m={m} n={n} k={k}"
        )


@needs_ext
def test_the_run_time_choice_follows_the_isa_cap(monkeypatch):
    """LMSTACK_MAX_ISA (read on every call): under `avx2` the automatic path (isa -1) is the AVX2
    one bit for bit, under `scalar` the plain C++ one."""
    if ext.best_isa() < 1:
        pytest.skip("this CPU has no AVX2 to cap")
    raw, _ = blocks_of(np.random.randn(37, 96), T.Q4_1)
    x = torch.randn(5, 96)
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx2")
    assert ext.best_isa() == 1
    assert torch.equal(
        ext.gguf_matmul_q8(x, raw, int(T.Q4_1), -1), ext.gguf_matmul_q8(x, raw, int(T.Q4_1), 1)
    )
    monkeypatch.setenv("LMSTACK_MAX_ISA", "scalar")
    assert ext.best_isa() == 0
    assert torch.equal(ext.gguf_matmul(x, raw, int(T.Q4_1), -1), ext.gguf_matmul(x, raw, int(T.Q4_1), 0))


def assert_rows_alike(matmul, typ: T, isa: int) -> None:
    """`matmul(x, blocks, type, isa)` gives each activation row the same bits alone or among any
    number of others, and at any offset in the batch, on fresh random shapes."""
    if ext.best_isa() < isa:
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    for m in (2, 3, 5, rng.randint(6, 33)):
        n, k = rng.randint(1, 70), 32 * rng.randint(1, 24)
        raw, _ = blocks_of(np.random.randn(n, k), typ)
        x = torch.randn(m, k)
        batched = matmul(x, raw, int(typ), isa)
        alone = torch.cat([matmul(x[i : i + 1], raw, int(typ), isa) for i in range(m)])
        assert torch.equal(batched, alone), f"{typ.name} m={m} n={n} k={k}"
        start = rng.randint(1, m - 1)
        assert torch.equal(matmul(x[start:], raw, int(typ), isa), batched[start:])


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_avx512_rows_are_computed_alike_whatever_the_batch(typ):
    """With AVX-512 the fp32 path computes a row alike whatever its batch: a speculative
    verification of several rows then computes exactly what one-row decode steps would."""
    assert_rows_alike(ext.gguf_matmul, typ, 2)


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_int8_activation_rows_are_computed_alike_whatever_the_batch(typ, isa):
    """`gguf_matmul_q8` (the default stack's decode kernel up to 5 rows), on every ISA: x is
    rounded per row, each output's integer dot products and their fp32 sums run in the same
    order whatever tile it lands in. With cpu-paged's batch-invariant rows, a speculative
    verification then reproduces plain decoding's logits (tests/test_spec_default_stack.py)."""
    assert_rows_alike(ext.gguf_matmul_q8, typ, isa)


def reference_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per 32-block as `quantize_q8` documents: dx = max|x| / 127 in fp32,
    q = round-half-even(x * (1 / dx)), and dx * sum(q)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv[..., None])
    return q.to(torch.int8).reshape(m, k), dx, dx * q.sum(-1)


@needs_ext
@pytest.mark.parametrize("isa", [0, 1], ids=["scalar", "avx2"])
def test_activations_round_to_int8_per_block_as_documented(isa):
    if isa > ext.best_isa():
        pytest.skip("this CPU has no AVX2+FMA+F16C")
    m, k = random.randint(1, 9), 32 * random.randint(1, 12)
    x = torch.randn(m, k + 3)[:, :k] * torch.tensor([1e-4, 1.0, 300.0])[torch.randint(0, 3, (m, 1))]
    x[0, :32] = 0.0  # an all-zero block: scale 0, q 0
    q, dx, sx = ext.quantize_q8(x, isa)
    rq, rdx, rsx = reference_q8(x)
    assert torch.equal(q, rq) and torch.equal(dx, rdx)
    assert torch.allclose(sx, rsx, rtol=1e-6, atol=0)
    assert int(q.abs().max()) <= 127


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_int8_activation_matmul_is_the_rounded_x_times_the_blocks(typ, isa):
    """gguf_matmul_q8 = (x rounded per block) @ W^T up to fp32 summation, on every tile shape
    (one row, the 4- and 8-row tiles and their remainders, odd N for the weight-row pairs, odd
    block counts for the AVX-512 block pairs)."""
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    for m in (1, 2, 3, rng.randint(4, 16), rng.randint(17, 40)):
        n, k = rng.choice((1, 2, 3)) * rng.randint(1, 40) + rng.randint(0, 1), 32 * rng.randint(1, 20)
        raw, w = blocks_of(np.random.randn(n, k) * rng.choice((1e-3, 1.0, 50.0)), typ)
        x = torch.randn(m, k + rng.randint(0, 5))[:, :k]
        q, dx, _ = reference_q8(x)
        xq = (q.double().reshape(m, -1, 32) * dx.double()[..., None]).reshape(m, k)
        out = ext.gguf_matmul_q8(x, raw, int(typ), isa)
        assert out.shape == (m, n) and within_rounding(out, xq, w, k), (
            f"{typ.name} isa {isa} m={m} n={n} k={k}"
        )
        # The price of the rounding, on Gaussian data: well under a percent of the size of the
        # products summed (not of the output itself: with few rows and columns an output can
        # cancel to near zero, and a relative error against it means nothing).
        exact = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        assert float((out.double() - exact).norm() / scale.norm()) < 0.02


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_the_gguf_package(typ):
    n, k = 37, 32 * random.randint(1, 12)
    raw, w = blocks_of(np.random.randn(n, k), typ)
    out = ext.gguf_dequantize(raw, int(typ), k)
    # d * q + m in one FMA here, in two roundings there: at most an ulp apart.
    assert torch.all((out - w).abs() <= 2**-23 * w.abs().clamp_min(2**-20))
    into = torch.empty(n, k)
    assert ext.gguf_dequantize(raw, int(typ), k, into).data_ptr() == into.data_ptr()
    assert torch.equal(into, out)
    # Into bf16 (a native-bf16 CPU's batches): torch's rounding of the fp32 values, in one pass.
    into16 = torch.empty(n, k, dtype=torch.bfloat16)
    assert torch.equal(ext.gguf_dequantize(raw, int(typ), k, into16), out.to(torch.bfloat16))


@needs_ext
def test_bad_inputs_are_one_line_errors():
    raw, _ = blocks_of(np.random.randn(4, 64), T.Q4_1)
    with pytest.raises(
        RuntimeError, match=r"type 12 is not one of Q4_0 \(2\), Q4_1 \(3\), Q8_0 \(8\), Q4_1G"
    ):
        ext.gguf_matmul(torch.randn(1, 64), raw, 12)
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 32"):
        ext.gguf_matmul(torch.randn(1, 48), raw, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="w rows hold 40 bytes; K = 96 needs 60"):
        ext.gguf_matmul(torch.randn(1, 96), raw, int(T.Q4_1))


def grouped_q4_1(n: int, k: int, gtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q4_1 block rows whose blocks share (d, m) within each group, the same rows as Q4_1G)."""
    per = 1 << (gtype - kernel.Q4_1G)
    raw, _ = blocks_of(np.random.randn(n, k) * random.choice((1e-3, 1.0, 50.0)), T.Q4_1)
    b = raw.view(n, k // 32, 20)
    b[..., :4] = b[:, ::per, :4][:, torch.arange(k // 32) // per].clone()
    return raw, kernel.group_q4_1(raw, k, gtype)


@needs_ext
@pytest.mark.parametrize("gtype", [1001, 1002, 1003], ids=["g64", "g128", "g256"])
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_grouped_q4_1_computes_what_its_q4_1_blocks_do(gtype, isa):
    """Q4_1G (one header per group) through every path gives the bits the same weights give as
    Q4_1 blocks (tested against the gguf package above): fp32 and int8 activations, dequantize,
    panels; K of 1-20 blocks, so that the row's last group is often short; odd N; strided x."""
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    for m in (1, 2, 3, rng.randint(4, 16), rng.randint(17, 40)):
        n, k = rng.choice((1, 2, 3)) * rng.randint(1, 40) + rng.randint(0, 1), 32 * rng.randint(1, 20)
        q41, grouped = grouped_q4_1(n, k, gtype)
        assert grouped.shape == (n, ext.row_bytes(gtype, k))
        x = torch.randn(m, k + rng.randint(0, 5))[:, :k]
        for matmul in (ext.gguf_matmul, ext.gguf_matmul_q8):
            assert torch.equal(matmul(x, grouped, gtype, isa), matmul(x, q41, int(T.Q4_1), isa)), (
                f"{matmul.__name__} isa {isa} m={m} n={n} k={k}"
            )
        if isa == 0:
            assert torch.equal(
                ext.gguf_dequantize(grouped, gtype, k), ext.gguf_dequantize(q41, int(T.Q4_1), k)
            )
        if isa >= 1:
            packed = ext.gguf_pack_panels(grouped, gtype, k)
            assert torch.equal(packed, ext.gguf_pack_panels(q41, int(T.Q4_1), k))
            assert torch.equal(ext.gguf_panel_blocks(packed, gtype, k, torch.arange(n)), q41)
            xc = x.contiguous()
            assert torch.equal(
                ext.gguf_matmul_panels(xc, packed, gtype, n, isa),
                ext.gguf_matmul_panels(xc, packed, int(T.Q4_1), n, isa),
            )


def test_grouped_layout_sizes_and_refusals():
    assert [kernel.grouped_type(g) for g in (32, 64, 128, 256, 512, 96)] == [
        None,
        1001,
        1002,
        1003,
        None,
        None,
    ]
    # 576 columns in groups of 128: four whole groups (4 + 64 bytes) and one of two blocks (4 + 32).
    assert ext is None or ext.row_bytes(1002, 576) == 4 * 68 + 36
    raw, _ = blocks_of(np.random.randn(3, 128), T.Q4_1)  # headers differ within the group
    with pytest.raises(ValueError, match="differ in \\(d, m\\) within groups of 128 columns"):
        kernel.group_q4_1(raw, 128, 1002)


def test_q8_0_rebuild_is_exact_or_refused():
    raw, w = blocks_of(np.random.randn(50, 96), T.Q8_0)
    assert torch.equal(kernel.quantize_q8_0_exact(w), raw)  # byte for byte
    assert kernel.quantize_q8_0_exact(torch.randn(50, 96)) is None  # not Q8_0 values
    assert kernel.quantize_q8_0_exact(torch.randn(4, 40)) is None  # K not whole blocks


def _layer(spec: LinearSpec, parts: list[GGUFTensor | torch.Tensor], dense_copy: bool = False) -> GGUFLinear:
    layer = GGUFLinear(spec, dense_copy=dense_copy)
    for i, part in enumerate(parts):
        layer.weight.weight_loader(layer.weight, part, i if len(parts) > 1 else None)
    layer.finalize()
    return layer


def _gguf(raw: torch.Tensor, typ: T, k: int) -> GGUFTensor:
    return GGUFTensor(data=raw.numpy(), ggml_type=typ, shape=(raw.shape[0], k))


@pytest.mark.parametrize("dense_copy", [False, True], ids=["dequantize", "dense-copy"])
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_fused_parts_keep_their_blocks(typ, dense_copy):
    k, sizes = 96, (5, 7, 3)
    made = [blocks_of(np.random.randn(s, k), typ) for s in sizes]
    spec = LinearSpec(k, sum(sizes), False, "layers.0.qkv_proj", sizes, "column", torch.float32)
    layer = _layer(spec, [_gguf(raw, typ, k) for raw, _ in made], dense_copy)
    w = torch.cat([deq for _, deq in made])
    assert layer.ggml_type == (int(typ) if kernel.native_kernel() else None)
    assert (layer.dense is not None) == (dense_copy or layer.ggml_type is None)
    for m in (1, 4, kernel.NATIVE_MAX_ROWS + 3):  # the kernel, and dequantize + matmul
        x = torch.randn(m, k)
        assert within_rounding(layer(x), x, w, k)
    ids = torch.tensor([0, 14, 6])
    assert torch.allclose(layer.rows(ids), w[ids], rtol=0, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_int8_activations_take_the_kernel_up_to_its_row_limit(typ):
    k, n = 96, 11
    raw, w = blocks_of(np.random.randn(n, k), typ)
    spec = LinearSpec(k, n, False, "layers.0.o_proj", (n,), "row", torch.float32)
    layer = GGUFLinear(spec, dense_copy=True, int8_activations=True)
    layer.weight.weight_loader(layer.weight, _gguf(raw, typ, k), None)
    layer.finalize()
    x = torch.randn(kernel.NATIVE_MAX_ROWS, k)
    assert torch.equal(layer(x), ext.gguf_matmul_q8(x, raw, int(typ)))
    assert torch.equal(layer(x[:1]), ext.gguf_matmul_q8(x[:1], raw, int(typ)))
    big = torch.randn(kernel.NATIVE_MAX_ROWS + 1, k)  # prefill: the dense copy, in fp32
    assert within_rounding(layer(big), big, w, k)
    head = GGUFLinear(spec, int8_activations=True, kernel_max_rows=None)  # an LM head: any batch
    head.set_blocks(int(typ), raw)
    assert torch.equal(head(big), ext.gguf_matmul_q8(big, raw, int(typ)))


@needs_ext
def test_bf16_copy_takes_batches_over_the_limit_and_rows_stay_exact():
    k, n = 96, 13
    raw, w = blocks_of(np.random.randn(n, k), T.Q4_1)
    spec = LinearSpec(k, n, False, "layers.0.o_proj", (n,), "row", torch.float32)
    layer = GGUFLinear(
        spec, dense_copy=True, int8_activations=True, copy_dtype=torch.bfloat16, kernel_max_rows=16
    )
    layer.weight.weight_loader(layer.weight, _gguf(raw, T.Q4_1, k), None)
    layer.finalize()
    assert layer.dense.dtype == torch.bfloat16
    x = torch.randn(17, k)
    assert torch.equal(layer(x[:16]), ext.gguf_matmul_q8(x[:16], raw, int(T.Q4_1)))
    out = layer(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, (x.bfloat16() @ w.float().bfloat16().T).float())
    ids = torch.tensor([0, 12, 5])
    assert torch.allclose(layer.rows(ids), w[ids].float(), rtol=0, atol=1e-6)  # from the blocks, not the copy


def test_prefill_auto_takes_the_panels_wherever_they_run_then_the_bf16_copy(monkeypatch):
    # The panels wherever they run, AMX CPUs included: `panels+bf16` (opt-in) is not
    # batch-invariant (tests/test_batch_invariance.py).
    from lmstack.errors import ConfigError
    from lmstack_gguf import quantizer

    for vnni in (False, True):
        monkeypatch.setattr(quantizer, "panels_cpu", lambda v=vnni: v)
        for native_bf16 in (False, True):
            monkeypatch.setattr(quantizer, "native_bf16_cpu", lambda v=native_bf16: v)
            want = "panels" if vnni else "dense-bf16" if native_bf16 else "dense-copy"
            assert quantizer.prefill_mode("auto", True) == want
            assert quantizer.prefill_mode("auto", False) == "dense-copy"
            for named in ("dense-copy", "dense-bf16", "dequantize"):
                assert quantizer.prefill_mode(named, True) == named
        for named in ("panels", "panels+bf16"):
            with pytest.raises(ConfigError, match=f"prefill: {re.escape(named)} multiplies int8 activations"):
                quantizer.prefill_mode(named, False)
            if vnni:
                assert quantizer.prefill_mode(named, True) == named
            else:
                with pytest.raises(ConfigError, match="needs AVX2"):
                    quantizer.prefill_mode(named, True)


needs_panels = pytest.mark.skipif(
    ext is None or ext.best_isa() < 1, reason="the panel kernel needs AVX2 and the built kernels"
)


@needs_panels
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", [1, 2], ids=["avx2", "avx512"])
def test_panels_are_the_rounded_x_times_the_blocks(typ, isa):
    """gguf_matmul_panels = (x rounded per block) @ W^T up to fp32 summation, and agrees with
    the block kernel, with each ISA's code: every row-tile remainder (M mod 4), N that leaves a
    single, a half or a partly filled last panel, K of 1-20 blocks, rows of x with a stride."""
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    for m in (1, 2, 3, 4, rng.randint(5, 16), rng.randint(17, 70)):
        n = rng.choice(
            (rng.randint(1, 15), 16 * rng.randint(1, 6) + rng.randint(0, 15), 32 * rng.randint(1, 3))
        )
        k = 32 * rng.randint(1, 20)
        raw, w = blocks_of(np.random.randn(n, k) * rng.choice((1e-3, 1.0, 50.0)), typ)
        x = torch.randn(m, k + rng.randint(0, 5))[:, :k]
        q, dx, _ = reference_q8(x)
        xq = (q.double().reshape(m, -1, 32) * dx.double()[..., None]).reshape(m, k)
        packed = ext.gguf_pack_panels(raw, int(typ), k)
        assert packed.shape[0] == -(-n // 16)
        # The blocks come back from the panels byte for byte (a layer may keep only the panels).
        ids = torch.tensor([n - 1, 0, *random.choices(range(n), k=3)])
        assert torch.equal(ext.gguf_panel_blocks(packed, int(typ), k, ids), raw[ids])
        out = ext.gguf_matmul_panels(x, packed, int(typ), n, isa)
        assert out.shape == (m, n) and within_rounding(out, xq, w, k), f"{typ.name} m={m} n={n} k={k}"
        blocks = ext.gguf_matmul_q8(x.contiguous(), raw, int(typ))
        assert float((out - blocks).abs().max()) <= 1e-5 * float(blocks.abs().max()) + 1e-30


@needs_panels
@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_panels_take_batches_over_the_limit_and_rows_stay_exact(typ):
    k, n = 96, 21
    raw, w = blocks_of(np.random.randn(n, k), typ)
    spec = LinearSpec(k, n, True, "layers.0.o_proj", (n,), "row", torch.float32)
    layer = GGUFLinear(spec, int8_activations=True, kernel_max_rows=5, panels=True)
    layer.weight.weight_loader(layer.weight, _gguf(raw, typ, k), None)
    layer.bias.data.normal_()
    layer.finalize()
    assert layer.dense is None and layer.panels is not None
    x = torch.randn(6, k)
    bias = layer.bias.data
    assert torch.equal(layer(x[:5]), ext.gguf_matmul_q8(x[:5], raw, int(typ)) + bias)
    assert torch.equal(layer(x), ext.gguf_matmul_panels(x, layer.panels, int(typ), n) + bias)
    assert torch.equal(layer(x.reshape(2, 3, k)), layer(x).reshape(2, 3, n))
    ids = torch.tensor([0, 20, 5])
    assert torch.equal(layer.rows(ids), w[ids])


@needs_panels
@pytest.mark.parametrize("bias", [False, True])
def test_panels_for_every_batch_make_a_rows_result_the_same_in_any_batch(bias):
    """`kernel_max_rows` 0 (what an AVX2-only CPU's layers get): every batch, one row included,
    multiplies by the panels, through the direct path when there is no bias; a row's result is
    then the same bits whatever batch it is in."""
    k, n = 32 * random.randint(1, 6), random.randint(1, 40)
    raw, _ = blocks_of(np.random.randn(n, k), T.Q4_1)
    spec = LinearSpec(k, n, bias, "layers.0.down_proj", (n,), "row", torch.float32)
    layer = GGUFLinear(spec, int8_activations=True, kernel_max_rows=0, panels=True)
    layer.weight.weight_loader(layer.weight, _gguf(raw, T.Q4_1, k), None)
    if bias:
        layer.bias.data.normal_()
    layer.finalize()
    assert layer._fast[0] is ext.gguf_matmul_panels  # bound either way; forward skips it with a bias
    plus = layer.bias.data if bias else 0
    x = torch.randn(random.randint(2, 40), k)
    out = layer(x)
    assert torch.equal(out, ext.gguf_matmul_panels(x, layer.panels, int(T.Q4_1), n) + plus)
    for i in (0, x.shape[0] - 1):
        assert torch.equal(layer(x[i : i + 1]), out[i : i + 1])
    # Only the panels are kept; rows (an embedding's lookup) and other dtypes are served from them.
    assert layer.panels_only and layer.weight.numel() == 0
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(layer.rows(ids), kernel.dequantize_blocks(raw, int(T.Q4_1), k)[ids])
    assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())


def test_layers_and_head_take_panels_for_every_batch_on_every_isa(monkeypatch):
    """The quantizer gives decoder layers and the Q8_0 LM head the panels for every batch
    wherever they run (AVX2 too, where the block kernel was a little faster at one row): one
    kernel for every batch computes a row alike whatever its batch-mates."""
    from lmstack_gguf import quantizer

    class Ext:
        def __init__(self, isa):
            self.isa = isa

        def best_isa(self):
            return self.isa

    for isa in (1, 2):
        monkeypatch.setattr(quantizer, "native_kernel", lambda isa=isa: Ext(isa))
        assert quantizer.layer_panels_min_rows() == 1
        assert quantizer.head_panels_min_rows() == 1


@needs_panels
def test_panels_then_the_bf16_copy_take_batches_by_size():
    """`prefill: panels+bf16`: the block kernel up to its limit, the panels up to `copy_min_rows`,
    the bfloat16 copy from there; the rows a batch holds do not change which path its rows take."""
    k, n = 96, 21
    raw, w = blocks_of(np.random.randn(n, k), T.Q4_1)
    spec = LinearSpec(k, n, True, "layers.0.o_proj", (n,), "row", torch.float32)
    layer = GGUFLinear(
        spec, dense_copy=True, int8_activations=True, kernel_max_rows=5, panels=True,
        copy_dtype=torch.bfloat16, copy_min_rows=9,
    )  # fmt: skip
    layer.weight.weight_loader(layer.weight, _gguf(raw, T.Q4_1, k), None)
    layer.bias.data.normal_()
    layer.finalize()
    assert layer.panels is not None and layer.dense.dtype == torch.bfloat16
    assert "bfloat16 copy for batches from 9 rows" in repr(layer)
    bias, typ = layer.bias.data, int(T.Q4_1)
    x = torch.randn(9, k)
    assert torch.equal(layer(x[:5]), ext.gguf_matmul_q8(x[:5], raw, typ) + bias)
    assert torch.equal(layer(x[:8]), ext.gguf_matmul_panels(x[:8], layer.panels, typ, n) + bias)
    assert torch.equal(layer(x), (x.bfloat16() @ w.float().bfloat16().T).float() + bias)
    assert torch.equal(layer(x.reshape(3, 3, k)), layer(x).reshape(3, 3, n))
    # Without the copy (`prefill: panels`) every batch over the limit takes the panels.
    plain = GGUFLinear(spec, int8_activations=True, kernel_max_rows=5, panels=True, copy_min_rows=9)
    plain.weight.weight_loader(plain.weight, _gguf(raw, T.Q4_1, k), None)
    plain.finalize()
    assert plain.dense is None and plain.copy_min_rows is None
    assert torch.equal(plain(x), ext.gguf_matmul_panels(x, plain.panels, typ, n))


@needs_panels
def test_panel_blocks_refuse_rows_outside_the_panels():
    raw, _ = blocks_of(np.random.randn(20, 64), T.Q4_1)
    packed = ext.gguf_pack_panels(raw, int(T.Q4_1), 64)
    with pytest.raises(RuntimeError, match="row 32 is not in the panels"):
        ext.gguf_panel_blocks(packed, int(T.Q4_1), 64, torch.tensor([0, 32]))


@needs_panels
def test_panels_refuse_bad_operands_in_one_line():
    raw, _ = blocks_of(np.random.randn(20, 64), T.Q4_1)
    packed = ext.gguf_pack_panels(raw, int(T.Q4_1), 64)
    with pytest.raises(RuntimeError, match="gguf_pack_panels' output for N = 40"):
        ext.gguf_matmul_panels(torch.randn(3, 64), packed, int(T.Q4_1), 40)
    with pytest.raises(RuntimeError, match="float32"):
        ext.gguf_matmul_panels(torch.randn(3, 64).double(), packed, int(T.Q4_1), 20)


def test_mixed_encodings_keep_one_segment_per_type():
    """Parts of different types (Q4_K_M's qkv mixes Q4_K and Q6_K) each keep their encoding."""
    k = 64
    q4, w4 = blocks_of(np.random.randn(6, k), T.Q4_1)
    q8, w8 = blocks_of(np.random.randn(4, k), T.Q8_0)
    dense = torch.randn(3, k)  # an F32 part
    spec = LinearSpec(k, 13, False, "layers.0.qkv_proj", (6, 4, 3), "column", torch.float32)
    layer = _layer(spec, [_gguf(q4, T.Q4_1, k), _gguf(q8, T.Q8_0, k), dense])
    if kernel.native_kernel() is None:
        assert layer.ggml_type is None and layer.dense.shape == (13, k)
    else:
        assert [t for t, _ in layer.segments] == [int(T.Q4_1), int(T.Q8_0), None] and layer.dense is None
    x = torch.randn(2, k)
    assert within_rounding(layer(x), x, torch.cat([w4, w8, dense]), k)


def test_row_parallel_split_keeps_whole_blocks():
    k, n = 128, 9
    raw, w = blocks_of(np.random.randn(n, k), T.Q4_1)
    outs = []
    for rank in (0, 1):
        spec = LinearSpec(k, n, False, "layers.0.o_proj", (n,), "row", torch.float32, tp_rank=rank, tp_size=2)
        layer = _layer(spec, [_gguf(raw, T.Q4_1, k)])
        assert layer.in_features == 64
        x = torch.randn(3, k)
        outs.append(
            (
                layer(x[:, rank * 64 : (rank + 1) * 64]),
                x[:, rank * 64 : (rank + 1) * 64],
                w[:, rank * 64 :][:, :64],
            )
        )
    for out, x, part in outs:
        assert within_rounding(out, x, part, 64)


def test_build_entry_point_never_fails(monkeypatch, capsys):
    monkeypatch.setattr(native.EXTENSION, "load_error", lambda: "no C++ compiler found")
    assert native.main() == 0
    assert "kernels NOT built (no C++ compiler found)" in capsys.readouterr().err
