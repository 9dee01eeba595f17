"""CPU int4 matmul through lmstack-gguf's C++ kernels: the layer re-laid out as Q4_1-style blocks.

A Q4_1 block is 32 values of one row: fp16 d, fp16 m, 16 bytes of 4-bit codes (value j in the low
nibble of byte j, value j + 16 in the high one), value = d * q + m. An int4 group of 32k columns
with (scale, zero) is k such blocks with d = scale and m = -zero * scale: the codes carry over
unchanged, d exactly (scales are fp16), m rounded once to fp16 (|error| <= 2^-12 * 15 * scale, far
below the half-step rounding of the codes themselves). Groups of 64, 128 or 256 columns (AWQ's
128) take lmstack-gguf's Q4_1G layout, the same blocks with one (d, m) header per group: 17 bytes
per 32 weights (0.53 a weight) where Q4_1 takes 20; groups of 32 (the int4 head) take Q4_1. The
blocks replace the layer's nibble buffer and hold its scales and zeros, so the module keeps one
copy of the weight and nothing beside it; `codes` reads the nibbles back.

Batches of at most `lmstack_gguf.api.NATIVE_MAX_ROWS` rows take the kernel with fp32
activations (the dequantized model's result up to fp32 summation order), or with
`layer.int8_activations` the kernel that rounds x to int8 per 32 values first (llama.cpp's
scheme, `fp32_activations: int8`). Larger ones (prefill) rebuild the weight a slab at a time into
a reused buffer and multiply densely: in bf16 on a CPU that computes it natively (x rounded to
bf16), else in fp32. Two options trade memory for batch speed: with int8 activations on a CPU
with AVX2 or AVX-512 VNNI every batch multiplies by the blocks re-laid out in 16-row panels
(lmstack-gguf's `prefill: panels`; 0.75 bytes a weight more), and `layer.bf16_copy` keeps a bf16
copy of the layer (2 bytes a weight more) for batches over 16 rows on a native-bf16 CPU.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from lmstack.kernels.hardware import native_bf16_cpu
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
    """Whether lmstack-gguf is installed (lmstack-awq's optional dependency `gguf`) and its
    kernels built on this machine (else the layers take torch's int4 op)."""
    try:
        from lmstack_gguf.api import native_kernel
    except ImportError:
        return False
    return native_kernel() is not None


class GGUFBlocks:
    @staticmethod
    def supports(layer) -> bool:
        return layer.in_features % QK == 0 and layer.group_size % QK == 0 and available()

    def __init__(self, layer) -> None:
        from lmstack_gguf.api import (
            BF16_COPY_MIN_ROWS,
            NATIVE_MAX_ROWS,
            group_q4_1,
            grouped_type,
            layer_panels_min_rows,
            native_kernel,
            panels_cpu,
        )

        n, k = layer.out_features, layer.in_features
        nb = k // QK
        codes = unpack_nibbles(layer.w_packed, k).view(n, nb, QK)
        nibbles = codes[..., : QK // 2] | (codes[..., QK // 2 :] << 4)
        # The (scale, zero) of the group each block's first column belongs to.
        scale = expand_groups(layer.w_scales.float(), k, layer.group_size)[:, ::QK]
        zero = expand_groups(layer.w_zeros.float(), k, layer.group_size)[:, ::QK]
        d, m = fp16_bytes(scale), fp16_bytes(-zero * scale)
        blocks = torch.cat((d, m, nibbles), dim=-1).reshape(n, nb * BLOCK_BYTES).contiguous()
        self.type = grouped_type(layer.group_size) or Q4_1
        layer.w_packed = blocks if self.type == Q4_1 else group_q4_1(blocks, k, self.type)
        # The blocks hold the scales and zeros now (`dequantized`, `row_values` read them back).
        layer.w_scales = layer.w_scales.new_empty(0)
        layer.w_zeros = layer.w_zeros.new_empty(0)
        ext = native_kernel()
        self.matmuls, self.max_rows = (ext.gguf_matmul, ext.gguf_matmul_q8), NATIVE_MAX_ROWS
        self.bf16 = native_bf16_cpu()
        self.dense: torch.Tensor | None = None
        # With int8 activations where the panel kernel runs (AVX2 or AVX-512 VNNI): panels (0.75
        # bytes a weight) take every batch (`layer_panels_min_rows`, measured by lmstack-gguf).
        self.panels: torch.Tensor | None = None
        self.panels_only = False
        if layer.int8_activations and panels_cpu():
            self.panels = ext.gguf_pack_panels(layer.w_packed, self.type, k)
            self.panel_matmul, self.max_rows = ext.gguf_matmul_panels, layer_panels_min_rows() - 1
            if self.max_rows == 0:
                # The panels take every batch: the blocks would only serve rows read back
                # (`blocks`), which the panels give too, so they are dropped.
                self.panels_only = True
                layer.w_packed = layer.w_packed.new_empty(n, 0)
            return
        # On a CPU with native bf16, batches over 16 rows (prefill, many streams) multiply in
        # bf16: the layer rebuilt per call overtook the fp32 kernel between 16 and 20 rows (2-core
        # Zen 4: 32 rows 403 vs 617 us for a 1536 x 576 layer, 14.6 vs 17.3 ms for the 49152 x 576
        # head), lmstack-gguf's `prefill: dense-bf16` crossover too. With `bf16_copy` a bfloat16
        # copy (2 bytes a weight) is kept for them instead, saving the rebuild (~1.3x the
        # matmul's time).
        if self.bf16:
            self.max_rows = BF16_COPY_MIN_ROWS - 1
            if getattr(layer, "bf16_copy", False):
                from lmstack_gguf.api import dequantize_blocks

                bf16 = torch.empty(n, k, dtype=torch.bfloat16)  # written in one pass
                self.dense = dequantize_blocks(layer.w_packed, self.type, k, bf16)

    @staticmethod
    def code_byte_offsets(k: int, typ: int) -> torch.Tensor:
        """[blocks, 16]: where each block's code bytes sit in a block row of type `typ`."""
        from lmstack_gguf.api import Q4_1G

        b = torch.arange(k // QK)
        if typ == Q4_1:
            start = b * BLOCK_BYTES + 4
        else:
            per = 1 << (typ - Q4_1G)
            start = (b // per) * (4 + 16 * per) + 4 + (b % per) * 16
        return start[:, None] + torch.arange(QK // 2)

    def direct(self, layer) -> tuple:
        """What `__call__` runs on decode rows, for `Int4Linear`'s fast path: ((op, args) with
        fp32 activations, (op, args) with int8 ones, most rows), the pair indexed by
        `layer.int8_activations` (read per call, as `__call__` does). With panels for every
        batch, both are the panel op, as in `__call__`."""
        if self.panels is not None and self.max_rows == 0:
            panels = (self.panel_matmul, (self.panels, self.type, layer.out_features))
            return (panels, panels, sys.maxsize)
        blocks = (layer.w_packed, self.type)
        return ((self.matmuls[0], blocks), (self.matmuls[1], blocks), self.max_rows)

    def blocks(self, layer, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(block rows of output rows `ids`, their type): from `w_packed`, or, where only the
        panels are kept, rebuilt from them (as Q4_1 for Q4_1G: the panels hold each block's d, m)."""
        if not self.panels_only:
            return layer.w_packed[ids], self.type
        from lmstack_gguf.api import native_kernel

        ext = native_kernel()
        return ext.gguf_panel_blocks(self.panels, self.type, layer.in_features, ids), Q4_1

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.panels_only:
            x32 = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
            out = self.panel_matmul(x32, self.panels, self.type, layer.out_features)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        if x.dtype == torch.float32 and x.shape[0] <= self.max_rows and x.stride(-1) == 1:
            # Decode: straight to the kernel (block_matmul's checks cost ~20 us a call, a good
            # part of a small layer's time at one row).
            return self.matmuls[layer.int8_activations](x, layer.w_packed, self.type)
        if self.panels is not None and x.dtype == torch.float32 and x.shape[0] > self.max_rows:
            return self.panel_matmul(
                x if x.stride(-1) == 1 else x.contiguous(), self.panels, self.type, layer.out_features
            )
        if self.dense is not None and x.shape[0] > self.max_rows:
            out = F.linear(x.to(torch.bfloat16), self.dense).float()
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        if x.shape[0] <= self.max_rows:
            return self(layer, x.float().contiguous()).to(x.dtype)
        return self.rebuilt_matmul(layer, x)

    def rebuilt_matmul(self, layer, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W rebuilt from the blocks a slab at a time (lmstack-gguf's
        `dequant_matmul`), multiplied in bf16 on a native-bf16 CPU (x rounded to bf16; fp32
        matmuls run ~3x slower there), else in fp32."""
        from lmstack_gguf.api import dequant_matmul

        xs = x.to(torch.bfloat16 if self.bf16 else torch.float32)
        out = dequant_matmul(xs, layer.w_packed, self.type, layer.in_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def row_codes(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """uint8 codes [len(ids), in] of output rows `ids`, read from their blocks."""
        rows, typ = self.blocks(layer, ids)
        blocks = rows[:, self.code_byte_offsets(layer.in_features, typ)]
        return torch.cat((blocks & 15, blocks >> 4), dim=-1).reshape(len(ids), layer.in_features)

    def row_values(self, layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Output rows `ids` as values [len(ids), in] in `dtype`: the blocks' d * q + m, what the
        matmul multiplies by (m rounded to fp16 once, see above). The tied head's embedding
        lookup: one native call where unpacking the codes and applying the groups' scales
        and zeros took ~10 torch ops (~110 us a decode step at one token, Zen 3)."""
        from lmstack_gguf.api import dequantize_blocks

        out = dequantize_blocks(*self.blocks(layer, ids), layer.in_features)
        return out if dtype == torch.float32 else out.to(dtype)

    def dequantized(self, layer) -> torch.Tensor:
        """The fp32 weight [out, in] the matmul multiplies by, rebuilt from the blocks (not kept)."""
        return self.row_values(layer, torch.arange(layer.out_features), torch.float32)

    def codes(self, layer) -> torch.Tensor:
        return self.row_codes(layer, torch.arange(layer.out_features))
