"""W4A16 in Triton: out[M, N] = x[M, K] @ ((code - zero) * scale)^T, two ways.

Both read the weight as loaded (no re-layout): `packed` uint8 [N, KB] with input column 2j in
the low nibble of byte j and 2j + 1 in the high one, `scales` [N, G] and `zeros` uint8 [N, G]
with group g covering columns [g * group, (g + 1) * group) (the last group may be short).

- `_w4a16_gemm`, for few rows (decode): each program takes a [BN, BKH]-byte tile of weight rows
  per step (contiguous along the row, so the loads coalesce), splits it into the even and odd
  input columns, dequantizes both in registers and does two dots against the matching columns
  of x, accumulating in fp32. When a step's 2 * BKH columns lie in one group (the group size a
  multiple of 2 * BKH, or a single group) one scale and zero per row serve the step; otherwise
  they are gathered per column, so any group size and a partial last group work. SPLIT_K
  programs share a row block's K range: a decode matmul has few row blocks (N / BN), too few to
  keep 132 SMs streaming, and each split writes its fp32 partial sum to its own slice of a
  workspace that one `sum` reduces (deterministic, unlike atomics).
- `_w4a16_dequant` + `F.linear`, for many rows: the kernel writes the weight out in the
  activation dtype once, and the matmul runs on the vendor library's GEMM. At a few hundred
  rows the GEMM's time dwarfs one pass over the weight, and a dequantizing GEMM as fast as the
  vendor's is a project of its own (measured: benchmarks/results/gpu-2026-12-04-h200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmstack.kernels.triton_support import reduce_splits, split_k, split_k_output


@triton.jit
def _w4a16_gemm(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,  # [SPLIT_K, M, N]: fp32 partial sums when SPLIT_K > 1, else [M, N] in x's dtype
    M,
    N,
    K,
    KB,
    G,
    group_size,
    stride_xm,
    stride_om,
    bytes_per_split,  # a multiple of BKH
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKH: tl.constexpr,  # bytes (pairs of input columns) per step
    GROUPED: tl.constexpr,  # every step's columns lie in one group
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rb = tl.arange(0, BKH)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * bytes_per_split
    k_hi = tl.minimum(k_lo + bytes_per_split, KB)
    for kb0 in range(k_lo, k_hi, BKH):
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
        wb = tl.load(w_ptr + rn[:, None] * KB + b[None, :], mask=n_ok[:, None] & (b < KB)[None, :], other=0)
        lo = (wb & 0xF).to(tl.float32)  # [BN, BKH]
        hi = (wb >> 4).to(tl.float32)
        if GROUPED:
            g = (2 * kb0) // group_size
            s = tl.load(s_ptr + rn * G + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rn * G + g, mask=n_ok, other=0).to(tl.float32)[:, None]
            we = (lo - z) * s
            wo = (hi - z) * s
        else:
            ge = ce // group_size
            go = co // group_size
            e_mask = n_ok[:, None] & e_ok[None, :]
            o_mask = n_ok[:, None] & o_ok[None, :]
            se = tl.load(s_ptr + rn[:, None] * G + ge[None, :], mask=e_mask, other=0.0).to(tl.float32)
            so = tl.load(s_ptr + rn[:, None] * G + go[None, :], mask=o_mask, other=0.0).to(tl.float32)
            ze = tl.load(z_ptr + rn[:, None] * G + ge[None, :], mask=e_mask, other=0).to(tl.float32)
            zo = tl.load(z_ptr + rn[:, None] * G + go[None, :], mask=o_mask, other=0).to(tl.float32)
            we = (lo - ze) * se
            wo = (hi - zo) * so
        if UPCAST:
            acc += tl.dot(xe.to(tl.float32), tl.trans(we), input_precision=DOT_PRECISION)
            acc += tl.dot(xo.to(tl.float32), tl.trans(wo), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(xe, tl.trans(we.to(xe.dtype)), input_precision=DOT_PRECISION)
            acc += tl.dot(xo, tl.trans(wo.to(xo.dtype)), input_precision=DOT_PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    dst = out_ptr + pid_k * M * N + rm[:, None] * stride_om + rn[None, :]
    tl.store(dst, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a16_dequant(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,  # [N, K] in the activation dtype
    N,
    K,
    KB,
    G,
    group_size,
    BN: tl.constexpr,
    BKH: tl.constexpr,
    GROUPED: tl.constexpr,  # the tile's 2 * BKH columns lie in one group
):
    # The tile's even and odd columns are decoded apart, then interleaved (join + reshape) so
    # that each row is stored contiguously; with one scale and zero per row when the tile lies
    # in one group. Per-column scale gathers and stride-2 stores made an earlier version ~20x
    # slower than a pass over memory on an H200 (benchmarks/results/gpu-2026-12-04-h200).
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    b0 = tl.program_id(1) * BKH
    b = b0 + tl.arange(0, BKH)
    n_ok = rn[:, None] < N
    wb = tl.load(w_ptr + rn[:, None] * KB + b[None, :], mask=n_ok & (b < KB)[None, :], other=0)
    lo = (wb & 0xF).to(tl.float32)
    hi = (wb >> 4).to(tl.float32)
    if GROUPED:
        g = (2 * b0) // group_size
        s = tl.load(s_ptr + rn * G + g, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + rn * G + g, mask=rn < N, other=0).to(tl.float32)[:, None]
        we = (lo - z) * s
        wo = (hi - z) * s
    else:
        ce = 2 * b
        co = ce + 1
        ge = (ce // group_size)[None, :]
        go = (co // group_size)[None, :]
        e_mask = n_ok & (ce < K)[None, :]
        o_mask = n_ok & (co < K)[None, :]
        se = tl.load(s_ptr + rn[:, None] * G + ge, mask=e_mask, other=0.0).to(tl.float32)
        so = tl.load(s_ptr + rn[:, None] * G + go, mask=o_mask, other=0.0).to(tl.float32)
        ze = tl.load(z_ptr + rn[:, None] * G + ge, mask=e_mask, other=0).to(tl.float32)
        zo = tl.load(z_ptr + rn[:, None] * G + go, mask=o_mask, other=0).to(tl.float32)
        we = (lo - ze) * se
        wo = (hi - zo) * so
    w = tl.reshape(tl.join(we, wo), (BN, 2 * BKH))  # columns 2b, 2b + 1 side by side
    c = 2 * b0 + tl.arange(0, 2 * BKH)
    tl.store(
        out_ptr + rn[:, None] * K + c[None, :], w.to(out_ptr.dtype.element_ty), mask=n_ok & (c < K)[None, :]
    )


def _grouped(groups: int, group_size: int, bkh: int) -> bool:
    """Whether every tile of 2 * bkh columns lies in one group (the kernels' GROUPED path)."""
    return groups == 1 or group_size % (2 * bkh) == 0


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of `_w4a16_gemm`: BM rows of x, BN weight rows, BKH bytes (2 * BKH input columns)
    per step; split_k programs share a row block's K range."""

    bm: int
    bn: int
    bkh: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# From DEQUANT_MIN_ROWS rows the weight is dequantized and multiplied by the vendor GEMM. On an
# H200 (benchmarks/results/gpu-2026-12-04-h200, second sweep) dequantizing a 4096 x 4096 weight
# takes ~17 us (2.6 TB/s); the dequantize path beat the GEMM at 32 rows on all three Llama-3-8B
# shapes (42 / 168 / 86 us against 77 / 248 / 130) and lost at 16 on the two large ones.
DEQUANT_MIN_ROWS = 32


def default_config(
    m: int, n: int, kb: int, interpret: bool = False, dtype: torch.dtype = torch.bfloat16
) -> GemmConfig:
    """Tiles for an [m, 2 kb] x [n, 2 kb]^T product: 128 weight rows by 64 bytes a step and
    enough K splits (each at least two steps long) to fill the GPU; 4 warps, 3 stages. Within
    7 % of the best of 32 configurations on the H200 sweep's 4096 x 14336 and 28672 x 4096
    shapes at 1, 16 and 64 rows (bf16). fp32 activations keep 64-row tiles: the sweep timed
    bf16 only, and 64 is what ran (correctly) in fp32 on the GPU."""
    if interpret:
        return GemmConfig(16 if m <= 16 else 32, 32, 16)
    bm, bn, bkh = (16 if m <= 16 else 64), (64 if dtype == torch.float32 else 128), 64
    return GemmConfig(bm, bn, bkh, split_k(triton.cdiv(m, bm) * triton.cdiv(n, bn), kb // bkh))


def w4a16_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    in_features: int,
    group_size: int,
    config: GemmConfig,
    *,
    interpret: bool = False,
) -> torch.Tensor:
    """`_w4a16_gemm` under `config`: [M, K] -> [M, N] in x's dtype."""
    m, k = x.shape
    n, kb = packed.shape
    c = config
    per_split, splits, out = split_k_output(kb, c.split_k, c.bkh, m, n, x.dtype, x.device)
    groups = scales.shape[1]
    grid = (triton.cdiv(m, c.bm), triton.cdiv(n, c.bn), splits)
    _w4a16_gemm[grid](
        x,
        packed,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        kb,
        groups,
        group_size,
        x.stride(0),
        n,
        per_split,
        BM=c.bm,
        BN=c.bn,
        BKH=c.bkh,
        GROUPED=_grouped(groups, group_size, c.bkh),
        UPCAST=interpret and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpret else "tf32",
        **({} if interpret else {"num_warps": c.num_warps, "num_stages": c.num_stages}),
    )
    return reduce_splits(out, x.dtype)


def w4a16_dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
    tile: tuple[int, int] = (32, 64),
) -> torch.Tensor:
    """The weight [N, K] in `dtype`, decoded on the GPU (or in the interpreter) in tiles of
    (weight rows, bytes)."""
    n, kb = packed.shape
    out = torch.empty(n, in_features, dtype=dtype, device=packed.device)
    bn, bkh = tile
    groups = scales.shape[1]
    grid = (triton.cdiv(n, bn), triton.cdiv(kb, bkh))
    _w4a16_dequant[grid](
        packed,
        scales,
        zeros,
        out,
        n,
        in_features,
        kb,
        groups,
        group_size,
        BN=bn,
        BKH=bkh,
        GROUPED=_grouped(groups, group_size, bkh),
    )
    return out


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    in_features: int,
    group_size: int,
    *,
    interpret: bool = False,
    dequant_min_rows: int = DEQUANT_MIN_ROWS,
) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) times the int4 weight [N, K] transposed -> [M, N] in x's dtype."""
    x = x.contiguous()
    m = x.shape[0]
    if m >= dequant_min_rows:
        return F.linear(x, w4a16_dequantize(packed, scales, zeros, in_features, group_size, x.dtype))
    config = default_config(m, packed.shape[0], packed.shape[1], interpret, x.dtype)
    return w4a16_gemm(x, packed, scales, zeros, in_features, group_size, config, interpret=interpret)


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
