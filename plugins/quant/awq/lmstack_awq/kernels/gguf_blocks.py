"""CPU int4 matmul through lmstack-gguf's C++ kernels: the layer re-laid out as GGUF Q4_1 blocks.

A Q4_1 block is 32 values of one row: fp16 d, fp16 m, 16 bytes of 4-bit codes (value j in the low
nibble of byte j, value j + 16 in the high one), value = d * q + m. An int4 group of 32k columns
with (scale, zero) is k such blocks with d = scale and m = -zero * scale: the codes carry over
unchanged, d exactly (scales are fp16), m rounded once to fp16 (|error| <= 2^-12 * 15 * scale, far
below the half-step rounding of the codes themselves). 20 bytes per 32 weights instead of 16 plus
the group's scale and zero, but the kernel reads them at memory speed at one row, where torch's
int4 op (`cpu_int4pack`) is bound by its own work (README).

Batches of at most `lmstack_gguf.kernel.NATIVE_MAX_ROWS` rows take the kernel with fp32
activations (the dequantized model's result up to fp32 summation order), or with
`layer.int8_activations` the kernel that rounds x to int8 per 32 values first (llama.cpp's
scheme, `fp32_activations: int8`); larger ones dequantize the blocks a slab at a time and
multiply densely in fp32 — or, with int8 activations on a CPU with AVX2 or AVX-512 VNNI, every
batch multiplies by the blocks re-laid out in 16-row panels (lmstack-gguf's `prefill: panels`)
— or, on a CPU with native bf16, from 17 rows, by a bf16 copy of the layer made at load (x
rounded to bf16). The blocks replace the layer's nibble buffer, so
the module holds one copy of the weight; `codes` reads the nibbles back.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from lmstack.hardware import native_bf16_cpu
from lmstack_awq.int4_math import expand_groups, unpack_nibbles

QK = 32
Q4_1 = 3  # the GGML type id
BLOCK_BYTES = 20


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [n, nb] -> uint8 [n, nb, 2]: each value as fp16, its little-endian bytes. (Not
    `.view(torch.uint8)`: a one-element-wide strided slice keeps its stride, which that refuses.)"""
    h = x.to(torch.float16).view(torch.int16).to(torch.int32)
    return torch.stack((h & 0xFF, (h >> 8) & 0xFF), dim=-1).to(torch.uint8)


def available() -> bool:
    """Whether lmstack-gguf is installed and its kernels built on this machine."""
    try:
        from lmstack_gguf.kernel import native_kernel
    except ImportError:
        return False
    return native_kernel() is not None


class GGUFBlocks:
    @staticmethod
    def supports(layer) -> bool:
        return layer.in_features % QK == 0 and layer.group_size % QK == 0 and available()

    def __init__(self, layer) -> None:
        n, k = layer.out_features, layer.in_features
        nb = k // QK
        codes = unpack_nibbles(layer.w_packed, k).view(n, nb, QK)
        nibbles = codes[..., : QK // 2] | (codes[..., QK // 2 :] << 4)
        # The (scale, zero) of the group each block's first column belongs to.
        scale = expand_groups(layer.w_scales.float(), k, layer.group_size)[:, ::QK]
        zero = expand_groups(layer.w_zeros.float(), k, layer.group_size)[:, ::QK]
        d, m = fp16_bytes(scale), fp16_bytes(-zero * scale)
        layer.w_packed = torch.cat((d, m, nibbles), dim=-1).reshape(n, nb * BLOCK_BYTES).contiguous()
        from lmstack_gguf.kernel import NATIVE_MAX_ROWS, native_kernel
        from lmstack_gguf.quantizer import BF16_COPY_MIN_ROWS, layer_panels_min_rows, panels_cpu

        ext = native_kernel()
        self.matmuls, self.max_rows = (ext.gguf_matmul, ext.gguf_matmul_q8), NATIVE_MAX_ROWS
        self.dense: torch.Tensor | None = None
        # With int8 activations where the panel kernel runs (AVX2 or AVX-512 VNNI): panels (0.75
        # bytes a weight) take every batch (`layer_panels_min_rows`, measured by lmstack-gguf).
        self.panels: torch.Tensor | None = None
        if layer.int8_activations and panels_cpu():
            self.panels = ext.gguf_pack_panels(layer.w_packed, Q4_1, k)
            self.panel_matmul, self.max_rows = ext.gguf_matmul_panels, layer_panels_min_rows() - 1
            return
        # On a CPU with native bf16 a bfloat16 copy (2 bytes a weight) takes batches over 16 rows
        # (prefill): its matmul runs ~4x faster than fp32 there, and rebuilding the layer in
        # fp32 per call cost a 200-token prompt ~3x the time to first token (lmstack-gguf's
        # `prefill: dense-bf16`, whose crossover this is). Elsewhere batches over 32 rows
        # dequantize a slab at a time.
        if native_bf16_cpu():
            from lmstack_gguf.kernel import dequantize_blocks

            self.dense = dequantize_blocks(layer.w_packed, Q4_1, k).to(torch.bfloat16)
            self.max_rows = BF16_COPY_MIN_ROWS - 1

    def direct(self, layer) -> tuple:
        """What `__call__` runs on decode rows, for `Int4Linear`'s fast path: ((op, args) with
        fp32 activations, (op, args) with int8 ones, most rows), the pair indexed by
        `layer.int8_activations` (read per call, as `__call__` does). With panels for every
        batch, both are the panel op, as in `__call__`."""
        if self.panels is not None and self.max_rows == 0:
            panels = (self.panel_matmul, (self.panels, Q4_1, layer.out_features))
            return (panels, panels, sys.maxsize)
        blocks = (layer.w_packed, Q4_1)
        return ((self.matmuls[0], blocks), (self.matmuls[1], blocks), self.max_rows)

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.shape[0] <= self.max_rows and x.stride(-1) == 1:
            # Decode: straight to the kernel (block_matmul's checks cost ~20 us a call, a good
            # part of a small layer's time at one row).
            return self.matmuls[layer.int8_activations](x, layer.w_packed, Q4_1)
        if self.panels is not None and x.dtype == torch.float32 and x.shape[0] > self.max_rows:
            return self.panel_matmul(
                x if x.stride(-1) == 1 else x.contiguous(), self.panels, Q4_1, layer.out_features
            )
        if self.dense is not None and x.shape[0] > self.max_rows:
            out = F.linear(x.to(torch.bfloat16), self.dense).float()
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        from lmstack_gguf.kernel import block_matmul

        out = block_matmul(x.float(), layer.w_packed, Q4_1, layer.in_features, max_rows=self.max_rows)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def row_codes(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """uint8 codes [len(ids), in] of output rows `ids`, read from their blocks."""
        blocks = layer.w_packed[ids].view(len(ids), -1, BLOCK_BYTES)[..., 4:]
        return torch.cat((blocks & 15, blocks >> 4), dim=-1).reshape(len(ids), layer.in_features)

    def row_values(self, layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Output rows `ids` as values [len(ids), in] in `dtype`: the blocks' d * q + m, what the
        matmul multiplies by (m rounded to fp16 once, see above). The tied head's embedding
        lookup: one native call where unpacking the codes and applying the groups' scales
        and zeros took ~10 torch ops (~110 us a decode step at one token, Zen 3)."""
        from lmstack_gguf.kernel import dequantize_blocks

        out = dequantize_blocks(layer.w_packed[ids], Q4_1, layer.in_features)
        return out if dtype == torch.float32 else out.to(dtype)

    def codes(self, layer) -> torch.Tensor:
        return self.row_codes(layer, torch.arange(layer.out_features))
