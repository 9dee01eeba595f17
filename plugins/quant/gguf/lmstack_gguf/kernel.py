"""GGUF blocks: which types are kept, multiplying by them, and rebuilding them.

`block_matmul(x [M, K], blocks, ggml_type)` -> [M, N] fp32:

- fp32 activations, at most `max_rows` rows (decode batches: `NATIVE_MAX_ROWS`; any number for
  an LM head with int8 activations), kernel built: the C++ kernel (csrc/gguf_matmul.cpp): the
  blocks are read as stored and widened to fp32 in registers, or, with `int8_activations`,
  multiplied in integers by x rounded to int8.
- otherwise (prefill, or no kernel): the blocks are dequantized `SLAB_BYTES` of fp32 at a time
  into a reused buffer and multiplied densely in fp32 — what the dequantized checkpoint computes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from lmstack.kernels.scratch import reused_buffer

# The GGML types kept as blocks (the C++ kernel's); any other type is dequantized at load.
KEPT_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
QK = 32  # values per block, every kept type
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
    kernel) (the C++ kernel, else the gguf package's numpy)."""
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
