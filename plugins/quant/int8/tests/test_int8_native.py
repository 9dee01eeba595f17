"""The C++ int8 kernel (csrc/int8_matmul.cpp) against a float64 reference, each of its
implementations (AVX2+FMA where the CPU has it, and plain C++), on fresh random shapes each run:
odd K (the vector loop's tail), odd N (the 4-row tiles' tail), M across the tile sizes, rows of x
with a stride, extreme scales; plus its input checks."""

from __future__ import annotations

import random

import pytest
import torch

from lmstack_int8 import native

ext = None
if native.load_error() is None:
    ext = native.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"the int8 kernel did not build: {native.load_error()}")


def isas() -> list[int]:
    return list(range(ext.best_isa() + 1)) if ext is not None else []


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_matches_float64_reference_on_random_shapes(isa):
    if isa not in isas():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    shapes = [(1, 1, 1), (1, 4, 8), (2, 5, 7), (3, 13, 577)]
    shapes += [(rng.randint(1, 40), rng.randint(1, 130), rng.randint(1, 700)) for _ in range(12)]
    for m, n, k in shapes:
        wide = torch.randn(m, k + rng.randint(0, 9))  # x as a column slice: rows with a stride
        x = wide[:, :k]
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) * rng.choice((1e-4, 1.0, 300.0)) + 1e-8
        out = ext.int8_matmul(x, q, scale, isa)
        assert out.shape == (m, n) and out.dtype == torch.float32
        ref = reference(x, q, scale)
        # fp32 products summed in another order: each output within a few ulps of the sum of
        # magnitudes (what bounds fp32 summation error), far below any int8 rounding.
        mag = x.abs().double() @ (q.abs().double() * scale.double()[:, None]).T
        err = (out.double() - ref).abs()
        assert torch.all(err <= 8 * k * 2**-24 * mag + 1e-30), f"isa {isa} m={m} n={n} k={k}"


def test_every_isa_gives_the_same_output_within_rounding():
    x, q = torch.randn(9, 203), torch.randint(-127, 128, (67, 203), dtype=torch.int8)
    scale = torch.rand(67)
    outs = [ext.int8_matmul(x, q, scale, isa).double() for isa in isas()]
    mag = x.abs().double() @ (q.abs().double() * scale.double()[:, None]).T
    for out in outs[1:]:
        assert torch.all((out - outs[0]).abs() <= 16 * 203 * 2**-24 * mag)


def test_empty_batch_and_bad_inputs():
    q, scale = torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8)
    assert ext.int8_matmul(torch.randn(0, 16), q, scale).shape == (0, 8)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ext.int8_matmul(torch.randn(2, 16, dtype=torch.bfloat16), q, scale)
    with pytest.raises(RuntimeError, match="x has 15 columns, q has 16"):
        ext.int8_matmul(torch.randn(2, 15), q, scale)
    with pytest.raises(RuntimeError, match="scale has 7 entries for 8 rows"):
        ext.int8_matmul(torch.randn(2, 16), q, scale[:7])
    with pytest.raises(RuntimeError, match="x rows must be contiguous"):
        ext.int8_matmul(torch.randn(16, 2).T, q, scale)


def test_build_entry_point_never_fails(monkeypatch, capsys):
    """`python -m lmstack_int8.native` (run by make install) exits 0 and says why not."""
    monkeypatch.setattr(native.EXTENSION, "load_error", lambda: "no C++ compiler found")
    assert native.main() == 0
    assert "kernel NOT built (no C++ compiler found)" in capsys.readouterr().err


def reference_q8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 activations in plain torch: each 32 values of x rounded to int8 with dx = max|x| / 127
    (the same fp32 operations as the kernel: x * (1 / dx), round half to even), exact integer
    dot products per block, then sum_b dx_b * dot_b * scale in float64. Returns (result, the
    sum of magnitudes that bounds the kernel's fp32 summation error)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    dx = blocks.abs().amax(dim=2) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv[..., None])
    qb = q.double().reshape(q.shape[0], k // 32, 32)
    dots = torch.einsum("mbi,nbi->mnb", xq.double(), qb)
    weight = dx.double()[:, None, :] * scale.double()[None, :, None]
    # The kernel's partial sums within a block may cancel: bound by the products' magnitudes.
    mag = torch.einsum("mbi,nbi->mnb", xq.double().abs(), qb.abs()) * weight
    return (dots * weight).sum(dim=2), mag.sum(dim=2)


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=["scalar", "avx2", "avx512", "avx512-vnni"])
def test_int8_activations_match_their_reference_on_random_shapes(isa):
    """`int8_matmul_q8` (the quantizer's `activations: int8`): x rounded exactly as documented
    (one rounding step off anywhere would move an output by far more than the bound), the
    integer dot products exact, fp32 sums of the blocks; odd N, M across the tile sizes, rows
    with a stride, extreme scales. And within the rounding's bound of the unrounded product."""
    if isa not in isas():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    rng = random.Random()
    shapes = [(1, 1, 32), (1, 4, 64), (2, 5, 96), (3, 13, 576)]
    shapes += [(rng.randint(1, 40), rng.randint(1, 130), 32 * rng.randint(1, 24)) for _ in range(12)]
    for m, n, k in shapes:
        wide = torch.randn(m, k + rng.randint(0, 9)) * rng.choice((1e-3, 1.0, 50.0))
        x = wide[:, :k]
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) * rng.choice((1e-4, 1.0, 300.0)) + 1e-8
        out = ext.int8_matmul_q8(x, q, scale, isa)
        assert out.shape == (m, n) and out.dtype == torch.float32
        ref, mag = reference_q8(x, q, scale)
        err = (out.double() - ref).abs()
        assert torch.all(err <= 8 * (k // 32 + 8) * 2**-24 * mag + 1e-30), f"isa {isa} m={m} n={n} k={k}"
        # Against the unrounded product: each x value moves by at most half its block's step.
        step = (x.reshape(m, k // 32, 32).abs().amax(dim=2) / 127).double()
        wsum = q.double().abs().reshape(n, k // 32, 32).sum(dim=2) * scale.double()[:, None]
        bound = (step[:, None, :] / 2 * wsum[None]).sum(dim=2) * (1 + 1e-4) + 8 * (k // 32 + 8) * 2**-24 * mag
        assert torch.all((out.double() - reference(x, q, scale)).abs() <= bound), (
            f"isa {isa} m={m} n={n} k={k}"
        )


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=["scalar", "avx2", "avx512", "avx512-vnni"])
def test_int8_activations_a_row_gets_the_same_bits_in_any_batch(isa):
    """A decode row and the same row inside a speculative verification's batch must give the
    same logits (greedy identity): every tile shape computes an output the same way."""
    if isa not in isas():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")
    x, q, scale = torch.randn(7, 224), torch.randint(-127, 128, (37, 224), dtype=torch.int8), torch.rand(37)
    batch = ext.int8_matmul_q8(x, q, scale, isa)
    for i in range(7):
        assert torch.equal(ext.int8_matmul_q8(x[i : i + 1], q, scale, isa)[0], batch[i])
    assert torch.equal(ext.int8_matmul_q8(x[2:5], q, scale, isa), batch[2:5])


def test_int8_activations_bad_inputs():
    q, scale = torch.randint(-127, 128, (8, 48), dtype=torch.int8), torch.rand(8)
    assert ext.int8_matmul_q8(torch.randn(0, 32), q[:, :32].contiguous(), scale).shape == (0, 8)
    with pytest.raises(RuntimeError, match="need K to be a multiple of 32, got 48"):
        ext.int8_matmul_q8(torch.randn(2, 48), q, scale)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ext.int8_matmul_q8(torch.randn(2, 32, dtype=torch.bfloat16), q[:, :32].contiguous(), scale)


def test_the_run_time_choice_follows_the_isa_cap(monkeypatch):
    """LMSTACK_MAX_ISA=avx2 (read on every call) on an AVX-512 CPU: the automatic path is AVX2's."""
    if ext.best_isa() < 2:
        pytest.skip("this CPU has no AVX-512 to cap")
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx2")
    assert ext.best_isa() == 1
    monkeypatch.setenv("LMSTACK_MAX_ISA", "scalar")
    assert ext.best_isa() == 0
