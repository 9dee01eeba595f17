"""The Triton kernels, in the Triton interpreter, against the dequantized reference: fresh random
shapes each run (odd sizes, partial groups, M across the 16-row tile), fp32 and bf16, through the
GEMM (with and without split K) and the dequantize-then-matmul path; and the kernels' bit
arithmetic decoding every e2m1 code and every e4m3 scale byte."""

from __future__ import annotations

import random

import pytest
import torch

from lmstack_nvfp4 import nvfp4
from lmstack_nvfp4.kernel import GemmConfig, nvfp4_dequantize, nvfp4_gemm, nvfp4_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantized_reference(dtype):
    rng = random.Random()
    for _ in range(3):
        m, n, k = rng.randint(1, 40), rng.randint(1, 70), rng.choice((16, 48, rng.randint(1, 100)))
        w, x = torch.randn(n, k), torch.randn(m, k).to(dtype)
        packed, scale, gs = nvfp4.quantize(w)
        factor = (1.0 / gs).expand(n)
        ref = x.float() @ nvfp4.dequantize(packed, scale, factor, k).T
        outs = {
            "default": nvfp4_matmul(x, packed, scale, factor, interpret=True),
            "dequant": nvfp4_matmul(x, packed, scale, factor, interpret=True, dequant_min_rows=1),
            "split": nvfp4_gemm(x, packed, scale, factor, GemmConfig(16, 16, 16, split_k=3), interpret=True),
            # The FP16_DECODE variant of the weight decode (not the default yet), both kernels.
            "fp16 decode": nvfp4_gemm(
                x, packed, scale, factor, GemmConfig(16, 32, 32, split_k=2, fp16_decode=True), interpret=True
            ),
            "fp16 decode, dequant": (
                x.float()
                @ nvfp4_dequantize(packed, scale, factor, k, torch.float32, True, fp16_decode=True).T
            ).to(dtype),
        }
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for name, out in outs.items():
            assert out.dtype == dtype and out.shape == (m, n), name
            torch.testing.assert_close(
                out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item(), msg=name
            )


@pytest.mark.parametrize("fp16_decode", [False, True])
def test_every_code_and_scale_byte_decodes_as_the_tables_say(fp16_decode):
    # Rows of one 16-column group: row r has scale byte r (all 256 but the two NaN codes) and
    # codes 0..15 (value 1.0 for the e4m3 check), so the decoded weight lists each value.
    scale_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    n = scale_bytes.numel()
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).expand(n, 8).contiguous()
    w = nvfp4_dequantize(
        packed,
        scale_bytes.view(nvfp4.E4M3)[:, None],
        torch.ones(n),
        16,
        torch.float32,
        True,
        fp16_decode=fp16_decode,
    )
    e2m1 = torch.cat((nvfp4.E2M1, -nvfp4.E2M1))
    expected = e2m1[None, :] * scale_bytes.view(nvfp4.E4M3).float()[:, None]
    assert torch.equal(w, expected)


def test_cpu_tensors_without_the_interpreter_are_refused():
    w = torch.randn(8, 16)
    packed, scale, gs = nvfp4.quantize(w)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or interpret=True"):
        nvfp4_matmul(torch.randn(2, 16), packed, scale, (1 / gs).expand(8))
