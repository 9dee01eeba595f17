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
