"""W4A16 dequant-GEMM in Triton: out[M, N] = x[M, K] @ ((code - zero) * scale)^T.

Reads the weight as loaded (no re-layout): `packed` uint8 [N, KB] with input column 2j in the
low nibble of byte j and 2j + 1 in the high one, `scales` [N, G] and `zeros` uint8 [N, G] with
group g covering columns [g * group, (g + 1) * group) (the last group may be short). Each step
takes BKH bytes of a row block, i.e. 2 * BKH input columns, splits them into the even and odd
columns, dequantizes both halves in registers and does two dots against the matching even / odd
columns of x, accumulating in fp32. Scales and zeros are gathered per column, so any group size
(and a partial last group) works without a special case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    KB,
    G,
    group_size,
    stride_xm,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKH: tl.constexpr,  # bytes (pairs of input columns) per step
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rb = tl.arange(0, BKH)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb0 in range(0, KB, BKH):
        b = kb0 + rb
        ce = 2 * b  # even input columns of this step
        co = ce + 1
        e_ok = ce < K
        o_ok = co < K
        xe = tl.load(
            x_ptr + rm[:, None] * stride_xm + ce[None, :], mask=m_ok[:, None] & e_ok[None, :], other=0.0
        )
        xo = tl.load(
            x_ptr + rm[:, None] * stride_xm + co[None, :], mask=m_ok[:, None] & o_ok[None, :], other=0.0
        )
        wb = tl.load(w_ptr + rn[None, :] * KB + b[:, None], mask=n_ok[None, :] & e_ok[:, None], other=0)
        lo = (wb & 0xF).to(tl.float32)  # [BKH, BN]
        hi = (wb >> 4).to(tl.float32)
        ge = ce // group_size
        go = co // group_size
        e_mask = n_ok[None, :] & e_ok[:, None]
        o_mask = n_ok[None, :] & o_ok[:, None]
        se = tl.load(s_ptr + rn[None, :] * G + ge[:, None], mask=e_mask, other=0.0).to(tl.float32)
        so = tl.load(s_ptr + rn[None, :] * G + go[:, None], mask=o_mask, other=0.0).to(tl.float32)
        ze = tl.load(z_ptr + rn[None, :] * G + ge[:, None], mask=e_mask, other=0).to(tl.float32)
        zo = tl.load(z_ptr + rn[None, :] * G + go[:, None], mask=o_mask, other=0).to(tl.float32)
        we = (lo - ze) * se
        wo = (hi - zo) * so
        if UPCAST:
            acc += tl.dot(xe.to(tl.float32), we, input_precision=DOT_PRECISION)
            acc += tl.dot(xo.to(tl.float32), wo, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(xe, we.to(xe.dtype), input_precision=DOT_PRECISION)
            acc += tl.dot(xo, wo.to(xo.dtype), input_precision=DOT_PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    in_features: int,
    group_size: int,
    *,
    interpret: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) times the int4 weight [N, K] transposed -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n, kb = packed.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bkh = 64, 32
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4a16_kernel[grid](
        x,
        packed,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        kb,
        scales.shape[1],
        group_size,
        x.stride(0),
        out.stride(0),
        BM=bm,
        BN=bn,
        BKH=bkh,
        UPCAST=interpret and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpret else "tf32",
    )
    return out


class TritonW4A16:
    def __init__(self, interpret: bool = False) -> None:
        self.interpret = interpret

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(
            x,
            layer.w_packed,
            layer.w_scales,
            layer.w_zeros,
            layer.in_features,
            layer.group_size,
            interpret=self.interpret,
        )

    def codes(self, layer) -> torch.Tensor:
        from lmstack_awq.int4_math import unpack_nibbles

        return unpack_nibbles(layer.w_packed, layer.in_features)
