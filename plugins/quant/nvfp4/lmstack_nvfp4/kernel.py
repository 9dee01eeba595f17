"""A Triton dequantizing GEMM for NVFP4 weights: out = x @ W^T with W decoded tile by tile.

Hopper (and anything before Blackwell) has no FP4 tensor cores, so the kernel widens the e2m1
codes and their e4m3 group scales (two small lookup tables) into the activation dtype inside
each K tile and runs the tile on the ordinary bf16 / fp16 / fp32 tensor cores; the per-row
factor (1 / global scale) multiplies the fp32 accumulator once at the end. Weights cross memory
at 4.5 bits each, which is what a memory-bound decode step pays for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmstack.triton_support import enable_interpreter
from lmstack_nvfp4.nvfp4 import E2M1, E4M3


@triton.jit
def _nvfp4_gemm(
    x_ptr,
    packed_ptr,
    scale_ptr,
    factor_ptr,
    e2m1_ptr,
    e4m3_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (fp32 inputs; the interpreter's bf16 is wrong)
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk[None, :] < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & in_k, other=0.0)
        w_mask = (rn[:, None] < N) & in_k
        byte = tl.load(packed_ptr + rn[:, None] * stride_pn + (rk // 2)[None, :], mask=w_mask, other=0)
        code = (byte.to(tl.int32) >> ((rk % 2) * 4)[None, :]) & 0xF  # even column: low nibble
        sbyte = tl.load(scale_ptr + rn[:, None] * stride_sn + (rk // 16)[None, :], mask=w_mask, other=0)
        w = tl.load(e2m1_ptr + code) * tl.load(e4m3_ptr + sbyte.to(tl.int32))  # [BLOCK_N, BLOCK_K]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # e2m1 x e4m3 products are exact in bf16/fp16
    factor = tl.load(factor_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * factor[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The e2m1 code -> value table (16, signed) and the e4m3 byte -> value table (256), fp32."""
    if device not in _TABLES:
        e2m1 = torch.cat((E2M1, -E2M1))
        e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
        _TABLES[device] = (e2m1.to(device), torch.nan_to_num(e4m3).to(device))
    return _TABLES[device]


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    factor: torch.Tensor,
    interpret: bool = False,
) -> torch.Tensor:
    """x [M, K] @ dequantized(packed [N, >= K/2], scale [N, >= K/16] e4m3, factor [N])^T -> [M, N]
    in x's dtype."""
    if interpret:
        enable_interpreter("nvfp4")
    elif not x.is_cuda:
        raise RuntimeError(
            "nvfp4: the Triton kernel needs CUDA tensors, or interpret=True (the Triton interpreter)"
        )
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    e2m1, e4m3 = _tables(x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = (32, 32) if interpret else (64, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nvfp4_gemm[grid](
        x,
        packed,
        scale.view(torch.uint8),
        factor.float().contiguous(),
        e2m1,
        e4m3,
        out,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=interpret or x.dtype == torch.float32,
    )
    return out
