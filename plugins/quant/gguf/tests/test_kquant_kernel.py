"""The packed K-quant / Q5_0 / Q5_1 kernels (csrc/kquants.cpp) against the gguf package's numpy
dequantization: `kq_dequantize` bit for bit (fp32, and bf16 as torch rounds it), `kq_matmul_q8`
against (x rounded per 32-block) @ the dequantized weights on every ISA the CPU has, odd shapes,
strided x, each row's bits alike alone or in any batch; random blocks (random bytes, finite
fp16 scales) with a fresh seed each run (printed on failure)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from lmstack_gguf import native

ext = None if native.load_error() else native.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"the kernels did not build: {native.load_error()}")

TYPES = [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# Where each block keeps its fp16 scales (d, and dmin / m where the type has one).
FP16_AT = {
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
ISAS = [0, 1, 2]
isa_ids = ["scalar", "avx2", "avx512"]


def random_blocks(typ: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] of random codes and scales, the fp16 scales finite (normal * 0.01, with
    some zeros, negatives and subnormals among them)."""
    values, size = GGML_QUANT_SIZES[typ]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in FP16_AT[typ]:
        d = (rng.standard_normal((n, k // values)) * 0.01).astype(np.float16)
        special = rng.random(d.shape)
        d[special < 0.05] = 0.0
        d[(special >= 0.05) & (special < 0.1)] = np.float16(3e-6)  # subnormal in fp16
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, typ: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, typ), dtype=np.float32))


def within_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """out vs x @ w^T in float64: each output within a few fp32 ulps of the sum of magnitudes
    (as test_gguf_kernel's bound)."""
    ref = x.double() @ w.double().T
    mag = x.abs().double() @ w.abs().double().T
    return bool(torch.all((out.double() - ref).abs() <= 8 * (k + 4) * 2**-24 * mag + 1e-30))


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: int8 q * dx per 32-block (quantize_q8, itself tested
    against its documented rounding in test_gguf_kernel)."""
    q, dx, _ = ext.quantize_q8(x)
    m, k = x.shape
    return (q.double().reshape(m, -1, 32) * dx.double()[..., None]).reshape(m, k)


def skip_missing(isa: int) -> None:
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")


def k_choices(typ: T) -> list[int]:
    values = GGML_QUANT_SIZES[typ][0]
    return [256, 512, 768] + ([32, 96, 224, 288] if values == 32 else [])


def test_types_and_row_bytes():
    assert ext.kq_types() == [int(t) for t in TYPES]
    for typ in TYPES:
        values, size = GGML_QUANT_SIZES[typ]
        assert ext.kq_row_bytes(int(typ), 3 * values) == 3 * size
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 256 for GGML type 12, got 288"):
        ext.kq_row_bytes(int(T.Q4_K), 288)
    with pytest.raises(RuntimeError, match=r"GGML type 2 is not one of Q5_0 \(6\)"):
        ext.kq_row_bytes(2, 256)
    raw = torch.from_numpy(random_blocks(T.Q4_K, 2, 256, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="w rows hold 144 bytes; K = 512 needs 288"):
        ext.kq_matmul_q8(torch.randn(1, 512), raw, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="isa must be -1"):
        ext.kq_dequantize(raw, int(T.Q4_K), 256, isa=3)
    with pytest.raises(RuntimeError, match="into must be a contiguous CPU float32 or bfloat16 tensor"):
        ext.kq_dequantize(raw, int(T.Q4_K), 256, torch.empty(2, 255))


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_dequantize_is_the_gguf_package_bit_for_bit(typ):
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for n in (1, 5, 37):
        k = int(rng.choice(k_choices(typ)))
        raw = random_blocks(typ, n, k, rng)
        ref = dequantized(raw, typ)
        w = torch.from_numpy(raw)
        for isa in range(ext.best_isa() + 1):
            out = ext.kq_dequantize(w, int(typ), k, isa=isa)
            assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (
                f"isa {isa} n={n} k={k} seed {seed}"
            )
            into = torch.empty(n, k)
            assert ext.kq_dequantize(w, int(typ), k, into, isa).data_ptr() == into.data_ptr()
            assert torch.equal(into.view(torch.int32), ref.view(torch.int32))
            into16 = torch.empty(n, k, dtype=torch.bfloat16)
            ext.kq_dequantize(w, int(typ), k, into16, isa)
            assert torch.equal(into16.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16)), (
                f"bf16 isa {isa} n={n} k={k} seed {seed}"
            )


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ISAS, ids=isa_ids)
def test_matmul_q8_is_the_rounded_x_times_the_dequantized_weights(typ, isa):
    """Every tile shape: one row (four weight rows at a time), the 4-row tiles and their
    remainders, odd N for the weight-row pairs, the legacy types' short last group of blocks."""
    skip_missing(isa)
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    # K: for the legacy types a short last group of blocks (9 and 7 blocks) in both paths.
    ks = [288, 224, 224, 288] if GGML_QUANT_SIZES[typ][0] == 32 else [256, 768, 512, 512]
    shapes = ((1, 1), (1, 37), (7, 3), (64, 37), (int(rng.integers(2, 20)), int(rng.integers(1, 40))))
    for (m, n), k in zip(shapes, [*ks, int(rng.choice(k_choices(typ)))]):
        raw = random_blocks(typ, n, k, rng)
        w = dequantized(raw, typ)
        x = torch.randn(m, k + int(rng.integers(1, 5)))[:, :k]  # rows with a stride
        out = ext.kq_matmul_q8(x, torch.from_numpy(raw), int(typ), isa)
        assert out.shape == (m, n) and within_rounding(out, rounded_x(x), w, k), (
            f"{typ.name} isa {isa} m={m} n={n} k={k} seed {seed}"
        )


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ISAS, ids=isa_ids)
def test_matmul_q8_rows_are_alike_whatever_the_batch(typ, isa):
    """A row multiplied alone gives the bits it gets among others, at any offset in the batch."""
    skip_missing(isa)
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for m in (2, 5, int(rng.integers(6, 20))):
        n, k = int(rng.integers(1, 40)), int(rng.choice(k_choices(typ)))
        raw = torch.from_numpy(random_blocks(typ, n, k, rng))
        x = torch.randn(m, k)
        batched = ext.kq_matmul_q8(x, raw, int(typ), isa)
        alone = torch.cat([ext.kq_matmul_q8(x[i : i + 1], raw, int(typ), isa) for i in range(m)])
        assert torch.equal(batched, alone), f"{typ.name} isa {isa} m={m} n={n} k={k} seed {seed}"
        start = int(rng.integers(1, m))
        assert torch.equal(ext.kq_matmul_q8(x[start:], raw, int(typ), isa), batched[start:])


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_isa_paths_agree(typ):
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    m, n, k = 9, 21, int(rng.choice(k_choices(typ)))
    raw = random_blocks(typ, n, k, rng)
    w = dequantized(raw, typ)
    x = torch.randn(m, k)
    outs = [ext.kq_matmul_q8(x, torch.from_numpy(raw), int(typ), isa) for isa in range(ext.best_isa() + 1)]
    # Each pair of paths within twice the bound each keeps to the exact product.
    mag = rounded_x(x).abs() @ w.abs().double().T
    for i, a in enumerate(outs):
        for b in outs[i + 1 :]:
            assert torch.all((a.double() - b.double()).abs() <= 16 * (k + 4) * 2**-24 * mag + 1e-30), (
                f"{typ.name} seed {seed}"
            )
