"""The Triton dequantizing GEMM, in the Triton interpreter, against the dequantized reference:
fresh random shapes each run (odd sizes, partial groups, M across the 16-row tile), fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

from lmstack_nvfp4 import nvfp4
from lmstack_nvfp4.kernel import nvfp4_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantized_reference(dtype):
    rng = random.Random()
    for _ in range(3):
        m, n, k = rng.randint(1, 40), rng.randint(1, 70), rng.choice((16, 48, rng.randint(1, 100)))
        w, x = torch.randn(n, k), torch.randn(m, k).to(dtype)
        packed, scale, gs = nvfp4.quantize(w)
        factor = (1.0 / gs).expand(n)
        ref = x.float() @ nvfp4.dequantize(packed, scale, factor, k).T
        out = nvfp4_matmul(x, packed, scale, factor, interpret=True)
        assert out.dtype == dtype and out.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_cpu_tensors_without_the_interpreter_are_refused():
    w = torch.randn(8, 16)
    packed, scale, gs = nvfp4.quantize(w)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or interpret=True"):
        nvfp4_matmul(torch.randn(2, 16), packed, scale, (1 / gs).expand(8))
