"""GGUF blocks: which types are kept, multiplying by them, and rebuilding them.

`block_matmul(x [M, K], blocks, ggml_type)` -> [M, N] fp32:

- fp32 activations, at most `max_rows` rows (decode batches: `NATIVE_MAX_ROWS`; any number for
  an LM head with int8 activations), kernel built: the C++ kernel (csrc/gguf_matmul.cpp): the
  blocks are read as stored and widened to fp32 in registers, or, with `int8_activations`,
  multiplied in integers by x rounded to int8.
- otherwise (prefill, or no kernel): the blocks are dequantized `SLAB_BYTES` of fp32 at a time
  into a reused buffer and multiplied densely in fp32 — what the dequantized checkpoint computes.

The K-quant and Q5_x types (`KQ_TYPES`) go through the extension's `kq_*` ops
(`kq_matmul_q8`: x rounded to int8 per 32 values as `gguf_matmul_q8` rounds it; `kq_dequantize`:
fp32 or bfloat16, bit-equal to the gguf package's). Where the built extension predates them,
`kq_matmul_q8` / `kq_dequantize` below compute the same thing in torch and numpy (slowly: the
rows are dequantized per call), so the layers keep the file's bytes either way. F16 / BF16
matrices are kept in their own dtype (`FLOAT_TYPES`) and widened a slab at a time.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from lmstack.kernels.scratch import reused_buffer

# The GGML types kept as blocks by the legacy kernels (panels, dense copies); KQ_TYPES and
# FLOAT_TYPES are kept too (`GGUFLinear`); any other type is dequantized at load.
KEPT_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
QK = 32  # values per block, every KEPT_TYPES type
# The `kq_*` ops' types: Q5_0, Q5_1 (32-value blocks) and the K-quants (256-value super-blocks).
KQ_TYPES = frozenset(
    int(GGMLQuantizationType[n]) for n in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
# The types `gguf_pack_panels` re-lays in 16-row panels (`prefill: panels`): the legacy ones, and
# Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K (kept as `kq_*` blocks where the panels do not run).
PANEL_TYPES = frozenset(
    int(GGMLQuantizationType[n]) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)
# The K-quants among them: as their blocks' `kquant_batches` rule says, batches over the layer's
# `kq_max_rows` multiply by slabs (dequantized from the panels, `kq_panel_dequantize`), x
# unrounded; the other panel types take the panels for every batch.
PANEL_KQUANTS = frozenset(int(GGMLQuantizationType[n]) for n in ("Q4_K", "Q5_K", "Q6_K"))
# Q6_K's panels only where AVX-512 VNNI runs: its AVX2 code (two dot products per block, the
# sixth bits spread to bytes, ~20 vector registers a tile) was slower than the kq kernel on the
# same CPU (Zen 4, AVX2 code, one thread, a 576 x 1536 layer: one row 46.8 vs 42.1 us, 32 rows
# 997 vs 657), where the AVX-512 code beats it (21.5 vs 34.4, 286 vs 509; README).
AVX512_PANELS_ONLY = frozenset({int(GGMLQuantizationType.Q6_K)})


def panel_types(isa: int) -> frozenset[int]:
    """The types a layer keeps as panels (`prefill: panels`) where the best code is `isa`."""
    return PANEL_TYPES if isa >= 2 else PANEL_TYPES - AVX512_PANELS_ONLY


F16, BF16 = int(GGMLQuantizationType.F16), int(GGMLQuantizationType.BF16)
FLOAT_TYPES = {F16: torch.float16, BF16: torch.bfloat16}
# Batches of at most this many rows multiply a K-quant layer by `kq_matmul_q8` (int8
# activations); larger ones dequantize it a slab at a time. Development measurement (2-core AMD
# EPYC with AVX-512 BF16 / VNNI, one thread, a busy machine: load ~8; a 3072 x 1024 Q4_K / Q6_K
# layer): the kernel against bfloat16 slabs 2.3 vs 2.6 ms at 32 rows, 11.5 vs 6.4 ms at 64;
# against fp32 slabs it was ahead at every size up to 128 rows (21 vs 34 ms), hence the
# second limit where the slabs are fp32 (README).
KQ_MAX_ROWS = 32
KQ_MAX_ROWS_FP32_SLABS = 128
# fp32 batches of at most this many rows take the C++ kernel (measured crossover with
# dequantize + fp32 matmul, README).
NATIVE_MAX_ROWS = 32
# The largest dequantized slab made at once (a 49152 x 576 head is 113 MB in fp32).
SLAB_BYTES = 8 << 20


def native_kernel():
    """The compiled kernels, or None where they cannot be built (then every layer is dequantized
    at load; the build's reason is logged once)."""
    from lmstack_gguf.native import EXTENSION

    return EXTENSION.module()


def block_bytes(ggml_type: int) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]


def block_values(ggml_type: int) -> int:
    """Values per block of a GGML type (1 for F16 / BF16)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]


def type_name(ggml_type: int) -> str:
    return GGMLQuantizationType(ggml_type).name


def kq_kernels():
    """The extension if it has the `kq_*` ops (csrc), else None (the torch / numpy fallback)."""
    ext = native_kernel()
    return ext if ext is not None and hasattr(ext, "kq_matmul_q8") else None


def kept_types() -> frozenset[int]:
    """Every GGML type a layer keeps as stored (where the extension is built)."""
    ext = kq_kernels()
    kq = frozenset(int(t) for t in ext.kq_types()) if ext is not None else KQ_TYPES
    return frozenset(int(t) for t in KEPT_TYPES) | kq | frozenset(FLOAT_TYPES)


def round_q8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as `gguf_matmul_q8` sees it: each 32-block rounded to int8 with scale max|x| / 127
    (round half to even), back in fp32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    return (torch.round(xb * inv[..., None]) * dx[..., None]).reshape(m, k)


def kq_dequantize(
    blocks: torch.Tensor, ggml_type: int, k: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """K-quant / Q5_x block rows [N, bytes] -> fp32 [N, k], or into `into` (fp32 or bfloat16)."""
    ext = kq_kernels()
    if ext is not None:
        return ext.kq_dequantize(blocks, int(ggml_type), k, into)
    dense = quants.dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type)).reshape(blocks.shape[0], k)
    out = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    return out if into is None else into.copy_(out)


def kq_matmul_q8(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """fp32 x [M, k] rounded to int8 per 32 values, times the K-quant / Q5_x rows -> fp32 [M, N]."""
    ext = kq_kernels()
    if ext is not None:
        return ext.kq_matmul_q8(x, blocks, int(ggml_type))
    k = x.shape[1]
    return dequant_matmul(round_q8(x), blocks, ggml_type, k)


# lmstack's own layout beside the GGML types (csrc/gguf_matmul.cpp): Q4_1 whose consecutive
# blocks of a 64-, 128- or 256-column group share one (d, m) header, type id Q4_1G + log2(group /
# 32). An int4 checkpoint quantized in groups of 128 (AWQ's) holds 0.53 bytes a weight so, where
# Q4_1's header per 32 values takes 0.625.
Q4_1G = 1000
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q4_1_BLOCK_BYTES = 20


def grouped_type(group_size: int) -> int | None:
    """The Q4_1G type id for groups of `group_size` columns, or None (plain Q4_1 then: 32, or a
    group that is not 64, 128 or 256)."""
    for shift in (1, 2, 3):
        if group_size == QK << shift:
            return Q4_1G + shift
    return None


def group_q4_1(blocks: torch.Tensor, k: int, gtype: int) -> torch.Tensor:
    """Q4_1 block rows [N, k / 32 * 20] whose blocks share (d, m) within each group -> the same
    rows in Q4_1G type `gtype` (one header per group; the row's last group may be short)."""
    per = 1 << (gtype - Q4_1G)
    n, nb = blocks.shape[0], k // QK
    b = blocks.view(n, nb, Q4_1_BLOCK_BYTES)
    heads = b[:, ::per, :4]
    if not torch.equal(b[..., :4], heads[:, torch.arange(nb) // per]):
        raise ValueError(f"Q4_1 blocks differ in (d, m) within groups of {per * QK} columns")
    codes, full = b[..., 4:], nb // per
    parts = [
        torch.cat((heads[:, :full], codes[:, : full * per].reshape(n, full, per * 16)), -1).reshape(n, -1)
    ]
    if nb > full * per:
        parts.append(torch.cat((heads[:, full], codes[:, full * per :].reshape(n, -1)), -1))
    return torch.cat(parts, 1).contiguous()


def dequantize_blocks(
    blocks: torch.Tensor, ggml_type: int, k: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 block rows [N, bytes] -> fp32 [N, k], or into `into` (float32, or bfloat16 with the C++
    kernel) (the C++ kernel, else the gguf package's numpy). K-quant / Q5_x rows go to
    `kq_dequantize`; F16 / BF16 rows (kept typed, [N, k]) are widened."""
    if blocks.dtype != torch.uint8:  # an F16 / BF16 matrix in its own dtype
        return blocks.float() if into is None else into.copy_(blocks)
    if int(ggml_type) in KQ_TYPES:
        return kq_dequantize(blocks, ggml_type, k, into)
    ext = native_kernel()
    if ext is not None:
        return ext.gguf_dequantize(blocks, int(ggml_type), k, into)
    dense = quants.dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type)).reshape(blocks.shape[0], k)
    out = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    return out if into is None else into.copy_(out)


def dequant_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """x @ W^T with W rebuilt in x's dtype (float32, or bfloat16 written by the C++ kernel in one
    pass), `SLAB_BYTES` of fp32 rows at a time, into a reused buffer."""
    n = blocks.shape[0]
    step = min(n, max(1, SLAB_BYTES // (4 * k)))
    if step == n:
        return F.linear(x, dequantize_blocks(blocks, ggml_type, k, reused_buffer(n, k, x.dtype)))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for r in range(0, n, step):
        rows = min(step, n - r)
        out[:, r : r + rows] = F.linear(
            x, dequantize_blocks(blocks[r : r + rows], ggml_type, k, reused_buffer(rows, k, x.dtype))
        )
    return out


def kernel_takes(x: torch.Tensor, use_native: bool = True, max_rows: int | None = NATIVE_MAX_ROWS) -> bool:
    """Whether `block_matmul` runs x through the C++ kernel (else it dequantizes); `max_rows`
    None: at any batch size."""
    return (
        use_native
        and x.dtype == torch.float32
        and (max_rows is None or x.shape[0] <= max_rows)
        and native_kernel() is not None
    )


def block_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    k: int,
    use_native: bool = True,
    *,
    int8_activations: bool = False,
    max_rows: int | None = NATIVE_MAX_ROWS,
) -> torch.Tensor:
    """x [M, k] @ W^T. `int8_activations`: the kernel rounds x to int8 per 32-block first and
    multiplies in integers (`gguf_matmul_q8`, llama.cpp's scheme); the dequantizing path is fp32."""
    if kernel_takes(x, use_native, max_rows):
        ext = native_kernel()
        matmul = ext.gguf_matmul_q8 if int8_activations else ext.gguf_matmul
        return matmul(x if x.stride(-1) == 1 else x.contiguous(), blocks, int(ggml_type))
    return dequant_matmul(x.float(), blocks, ggml_type, k).to(x.dtype)


def quantize_q8_0_exact(w: torch.Tensor) -> torch.Tensor | None:
    """Q8_0 blocks (uint8 [N, K / 32 * 34]) of an fp32 matrix, if they reproduce it exactly;
    else None. A table dequantized from Q8_0 (a GGUF's embedding) comes back byte for byte, so
    the tied LM head can be served from blocks without changing a single logit."""
    n, k = w.shape
    if k % QK:
        return None
    x = w.float().reshape(n, k // QK, QK)
    d32 = x.abs().amax(dim=-1) / 127.0
    inv = torch.where(d32 > 0, 1.0 / d32, torch.zeros_like(d32))
    scaled = x * inv[..., None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp_(-127, 127)  # roundf: ties away from 0
    d16 = d32.half()
    if not torch.equal(q * d16.float()[..., None], x):
        return None
    blocks = torch.empty(n, k // QK, 34, dtype=torch.uint8)
    blocks[..., :2] = d16.contiguous().view(torch.uint8).view(n, k // QK, 2)
    blocks[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return blocks.view(n, -1)
