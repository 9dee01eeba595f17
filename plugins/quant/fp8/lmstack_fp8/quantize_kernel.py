"""Per-token FP8 activation quantization in one Triton kernel, for the CUDA scaled_mm path.

`fp8.token_scales` + `fp8.to_fp8` are nine small torch ops (upcast, abs, amax, divide, clamp;
upcast, divide, clamp, cast); on an H200 they took 95-250 us per layer call at 1-1024 rows,
against 9-23 us for this kernel and 17-183 us for the matmul itself (Llama-3-8B shapes,
benchmarks/results/gpu-2026-12-04-h200). One program per row: a pass for the absmax, a pass to
scale, saturate and round. The arithmetic is fp8.py's, to the bit: scale = max(absmax * fp32(1 /
448), 1e-12), codes = clamp(x / scale, -448, 448) rounded to e4m3 with an IEEE round-to-nearest
division (Triton's `/` is an approximate division on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmstack.kernels.triton_support import enable_interpreter
from lmstack_fp8 import fp8

BLOCK = 1024


@triton.jit
def _quantize_rows(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    INV_MAX: tl.constexpr,
    TINY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) * INV_MAX, TINY)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + rk, q.to(q_ptr.dtype.element_ty), mask=rk < K)


def quantize_tokens(x: torch.Tensor, interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], fp32 scales [M, 1]) of x [M, K] (a CUDA tensor, or any with
    `interpret`: the Triton interpreter, for tests), rows contiguous: what
    `fp8.to_fp8(x, fp8.token_scales(x))` computes."""
    if interpret:
        enable_interpreter("fp8")
    m, k = x.shape
    q = torch.empty(m, k, dtype=fp8.FP8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows[(m,)](
            x,
            q,
            scales,
            k,
            x.stride(0),
            q.stride(0),
            FP8_MAX=fp8.FP8_MAX,
            INV_MAX=1.0 / fp8.FP8_MAX,
            TINY=fp8._TINY,
            BLOCK=BLOCK,
        )
    return q, scales
