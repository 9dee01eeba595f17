"""Triton kernels for NVFP4 weights: out = x @ W^T, two ways.

Hopper (and anything before Blackwell) has no FP4 tensor cores, so the e2m1 codes and their e4m3
group scales are widened in registers, by bit arithmetic rather than table lookups (a gather per
element from a table in global memory was the slowest part of an earlier version), into the
activation dtype; the per-row factor (1 / global scale) multiplies the fp32 accumulator once.
e2m1 x e4m3 products are exact in bf16 / fp16.

- `_nvfp4_gemm`, for few rows (decode): tiles of x and W, the dot on the ordinary bf16 / fp16 /
  fp32 tensor cores. SPLIT_K programs share a row block's K range (a decode matmul has too few
  row blocks to keep every SM streaming); each writes its fp32 partial sum to its own slice of a
  workspace that one `sum` reduces (deterministic, unlike atomics). Weights cross memory at 4.5
  bits each, which is what a memory-bound decode step pays for.
- `_nvfp4_dequant` + `F.linear`, for many rows: the weight written out in the activation dtype
  once, the matmul on the vendor library's GEMM (as lmstack-awq does; see its kernel module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmstack.kernels.triton_support import enable_interpreter, reduce_splits, split_k, split_k_output


@triton.jit
def _e2m1(code):
    """fp32 value of 4-bit e2m1 codes (sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    mag = code & 7
    exp = mag >> 1
    normal = (((exp + 126) << 23) | ((mag & 1) << 22)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, (mag & 1).to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _e4m3(byte):
    """fp32 value of e4m3 bytes (sign, 4 exponent bits with bias 7, 3 mantissa bits; the NaN
    codes 0x7f / 0xff never occur as NVFP4 scales)."""
    exp = (byte >> 3) & 0xF
    man = byte & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
    return tl.where((byte & 0x80) != 0, -value, value)


# The FP16_DECODE variant (not the default until timed on a GPU: the second H200 lease ended
# before it ran) decodes both formats by moving their bits into an fp16's: sign to bit 15,
# exponent and mantissa to the top of fp16's. The fp16 then holds the value times 2^-(15 - bias),
# subnormals included (fp16's line up with theirs), and a power of two restores it: a few integer
# operations and no selects per element, where decoding looked like the kernels' bound.
E2M1_SHIFT = tl.constexpr(16384.0)  # 2^14: fp16's exponent bias 15 against e2m1's 1
E4M3_SHIFT = tl.constexpr(256.0)  # 2^8: against e4m3's 7


@triton.jit
def _e2m1_fp16(code):
    """4-bit e2m1 codes as fp32 values divided by E2M1_SHIFT (through an fp16's bits)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_fp16(byte):
    """fp32 value of e4m3 bytes, through an fp16's bits (NaN codes never occur as scales)."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * E4M3_SHIFT


@triton.jit
def _weight_tile(
    packed_ptr,
    scale_ptr,
    rn,
    k0,
    N,
    K,
    stride_pn,
    stride_sn,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FP16_DECODE: tl.constexpr,
):
    """Decoded W[rn, k0:k0 + BK] (fp32, without the row factor), zero outside [N, K]. Each byte
    is loaded once and split into its two codes, and each e4m3 scale is decoded once for its 16
    columns: decoding per element (a scale decode and a byte load per weight) made the kernels
    bound by integer arithmetic, not memory, on an H200 (benchmarks/results/gpu-2026-12-04-h200)."""
    rb = k0 // 2 + tl.arange(0, BK // 2)
    rg = k0 // 16 + tl.arange(0, BK // 16)
    n_ok = (rn < N)[:, None]
    byte = tl.load(
        packed_ptr + rn[:, None] * stride_pn + rb[None, :], mask=n_ok & (2 * rb < K)[None, :], other=0
    ).to(tl.int32)
    sbyte = tl.load(
        scale_ptr + rn[:, None] * stride_sn + rg[None, :], mask=n_ok & (16 * rg < K)[None, :], other=0
    ).to(tl.int32)
    if FP16_DECODE:
        codes = tl.join(_e2m1_fp16(byte & 0xF), _e2m1_fp16(byte >> 4))
        scales = _e4m3_fp16(sbyte) * E2M1_SHIFT
    else:
        codes = tl.join(_e2m1(byte & 0xF), _e2m1(byte >> 4))  # [BN, BK / 2, 2]: columns 2b, 2b + 1
        scales = _e4m3(sbyte)
    w = tl.reshape(codes, (BN, BK // 16, 16)) * scales[:, :, None]
    rk = k0 + tl.arange(0, BK)
    return tl.where(rk[None, :] < K, tl.reshape(w, (BN, BK)), 0.0)


@triton.jit
def _nvfp4_gemm(
    x_ptr,
    packed_ptr,
    scale_ptr,
    factor_ptr,
    out_ptr,  # [SPLIT_K, M, N]: fp32 partial sums when split, else [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (fp32 inputs; the interpreter's bf16 is wrong)
    FP16_DECODE: tl.constexpr,
):
    pid_k = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        w = _weight_tile(
            packed_ptr, scale_ptr, rn, k0, N, K, stride_pn, stride_sn, BLOCK_N, BLOCK_K, FP16_DECODE
        )
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    factor = tl.load(factor_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * factor[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    dst = out_ptr + pid_k * M * N + rm[:, None] * stride_om + rn[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _nvfp4_dequant(
    packed_ptr,
    scale_ptr,
    factor_ptr,
    out_ptr,  # [N, K] in the activation dtype
    N,
    K,
    stride_pn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP16_DECODE: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    w = _weight_tile(packed_ptr, scale_ptr, rn, k0, N, K, stride_pn, stride_sn, BLOCK_N, BLOCK_K, FP16_DECODE)
    w = w * tl.load(factor_ptr + rn, mask=rn < N, other=0.0)[:, None]
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of `_nvfp4_gemm`; split_k programs share a row block's K range."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fp16_decode: bool = False  # the FP16_DECODE variant of the weight decode (see above)


# From DEQUANT_MIN_ROWS rows the weight is dequantized and multiplied by the vendor GEMM (on an
# H200 the dequantize path at 128 rows, 109-695 us on Llama-3-8B shapes, was already about what
# the GEMM took at 64 rows, 94-452 us: benchmarks/results/gpu-2026-12-04-h200).
DEQUANT_MIN_ROWS = 128


def default_config(
    m: int, n: int, k: int, interpret: bool = False, dtype: torch.dtype = torch.bfloat16
) -> GemmConfig:
    """128 weight rows by 128 columns a step, enough K splits (each at least two steps long) to
    fill the GPU; 4 warps, 3 stages: within 7 % of the best of 32 configurations on the H200
    sweep's shapes at 1 and 16 rows (12 % at 64; bf16). fp32 activations keep 64-row tiles: the
    sweep timed bf16 only, and 64 is what ran (correctly) in fp32 on the GPU."""
    if interpret:
        return GemmConfig(16 if m <= 16 else 64, 32, 32)
    block_m, block_k = (16 if m <= 16 else 64), 128
    block_n = 64 if dtype == torch.float32 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return GemmConfig(block_m, block_n, block_k, split_k(tiles, k // block_k))


def _check_device(x: torch.Tensor, interpret: bool) -> None:
    if interpret:
        enable_interpreter("nvfp4")
    elif not x.is_cuda:
        raise RuntimeError(
            "nvfp4: the Triton kernel needs CUDA tensors, or interpret=True (the Triton interpreter)"
        )


def nvfp4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    factor: torch.Tensor,
    config: GemmConfig,
    interpret: bool = False,
) -> torch.Tensor:
    """`_nvfp4_gemm` under `config`: x [M, K] -> [M, N] in x's dtype."""
    _check_device(x, interpret)
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    c = config
    per_split, splits, out = split_k_output(k, c.split_k, c.block_k, m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), splits)
    _nvfp4_gemm[grid](
        x,
        packed,
        scale.view(torch.uint8),
        factor.float().contiguous(),
        out,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        n,
        per_split,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        UPCAST=interpret or x.dtype == torch.float32,
        FP16_DECODE=c.fp16_decode,
        **({} if interpret else {"num_warps": c.num_warps, "num_stages": c.num_stages}),
    )
    return reduce_splits(out, x.dtype)


def nvfp4_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    factor: torch.Tensor,
    in_features: int,
    dtype: torch.dtype,
    interpret: bool = False,
    tile: tuple[int, int] = (32, 128),
    fp16_decode: bool = False,
) -> torch.Tensor:
    """The weight [N, in_features] in `dtype`, row factors applied, decoded by `_nvfp4_dequant`."""
    _check_device(packed, interpret)
    n = packed.shape[0]
    out = torch.empty(n, in_features, dtype=dtype, device=packed.device)
    block_n, block_k = tile
    grid = (triton.cdiv(n, block_n), triton.cdiv(in_features, block_k))
    _nvfp4_dequant[grid](
        packed,
        scale.view(torch.uint8),
        factor.float().contiguous(),
        out,
        n,
        in_features,
        packed.stride(0),
        scale.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP16_DECODE=fp16_decode,
    )
    return out


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    factor: torch.Tensor,
    interpret: bool = False,
    dequant_min_rows: int = DEQUANT_MIN_ROWS,
) -> torch.Tensor:
    """x [M, K] @ dequantized(packed [N, >= K/2], scale [N, >= K/16] e4m3, factor [N])^T -> [M, N]
    in x's dtype."""
    m, k = x.shape
    if m >= dequant_min_rows:
        return F.linear(x, nvfp4_dequantize(packed, scale, factor, k, x.dtype, interpret))
    config = default_config(m, packed.shape[0], k, interpret, x.dtype)
    return nvfp4_gemm(x, packed, scale, factor, config, interpret)
