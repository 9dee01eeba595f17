"""CPU int4 matmul through PyTorch's `_weight_int4pack_mm_for_cpu` (the kernel gpt-fast and
torchao use on the CPU).

It wants the codes re-laid out by `_convert_weight_to_int4pack_for_cpu` (done once; the result
replaces the layer's nibble buffer, same size) and, per group of `gk` input columns, a
(scale, offset) pair with w = (code - 8) * scale + offset; our w = (code - zero) * scale gives
offset = (8 - zero) * scale. The op needs out % 16 == 0, in % 32 == 0 and gk in {32, 64, 128,
256} dividing `in`: a checkpoint group of 128 over 576 inputs (4.5 groups) is served as nine
groups of 64, each carrying its 128-group's scale, which is exact.
"""

from __future__ import annotations

import torch

from lmstack_awq.int4_math import expand_groups, unpack_nibbles

INNER_K_TILES = 2
# fp32 activations: the op's fp32 path is a slow one (qkv at M = 1: ~1.3 ms against ~0.1 ms in
# bf16, README), so a few rows go through it in bf16 (rounding the activations to bf16, which
# the int4 weights' own error dwarfs) and come back as fp32; from this many rows (prefill) the
# weight is decoded once per call and multiplied densely in fp32, which wins there.
FP32_DEQUANT_MIN_ROWS = 64
_GK = (256, 128, 64, 32)


def kernel_group(in_features: int, group_size: int) -> int | None:
    """The largest op group size that divides both the checkpoint's groups and the input."""
    for gk in _GK:
        if group_size % gk == 0 and in_features % gk == 0:
            return gk
    return None


class CpuInt4Pack:
    @staticmethod
    def supports(layer) -> bool:
        return (
            layer.out_features % BLOCK_ROWS == 0
            and layer.in_features % (16 * INNER_K_TILES) == 0
            and kernel_group(layer.in_features, layer.group_size) is not None
        )

    def __init__(self, layer) -> None:
        k = layer.in_features
        self.gk = kernel_group(k, layer.group_size)
        codes = unpack_nibbles(layer.w_packed, k).to(torch.int32)
        layer.w_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        # Per op group: the scale / zero of the checkpoint group its first column belongs to.
        scale = expand_groups(layer.w_scales.float(), k, layer.group_size)[:, :: self.gk]
        zero = expand_groups(layer.w_zeros.float(), k, layer.group_size)[:, :: self.gk]
        self.scale_zero32 = torch.stack([scale.t(), ((8 - zero) * scale).t()], dim=-1).contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {torch.float32: self.scale_zero32}
        self._map: torch.Tensor | None = None

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.shape[0] >= FP32_DEQUANT_MIN_ROWS or layer.exact_fp32:
                return x @ self.dequantized(layer).t()
            return self(layer, x.to(torch.bfloat16)).float()
        sz = self._by_dtype.get(x.dtype)
        if sz is None:
            sz = self._by_dtype[x.dtype] = self.scale_zero32.to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.w_packed, self.gk, sz)

    def dequantized(self, layer) -> torch.Tensor:
        """The fp32 weight [out, in], decoded from the packed layout (not kept)."""
        from lmstack_awq.int4_math import dequantize_int4

        k = layer.in_features
        if self._map is None:
            self._map = block_nibble_map(k)
        # Every block of 32 rows has the same layout: one gather of its nibbles puts them back
        # in (row, column) order.
        blocks = layer.w_packed.view(-1, BLOCK_ROWS * k // 2)
        nibbles = torch.stack((blocks & 15, blocks >> 4), dim=-1).view(blocks.shape[0], -1)
        codes = nibbles.index_select(1, self._map.view(-1)).view(-1, k)
        return dequantize_int4(codes, layer.w_scales, layer.w_zeros, layer.group_size, torch.float32)

    def row_codes(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """uint8 codes [len(ids), in] of output rows `ids`, read straight from the packed layout
        (the embedding lookup of a tied int4 head)."""
        k = layer.in_features
        if self._map is None:
            self._map = block_nibble_map(k)
        where = self._map[ids % BLOCK_ROWS]  # [T, in] nibble positions inside the row's block
        blocks = layer.w_packed.view(-1, BLOCK_ROWS * k // 2)
        byte = blocks[(ids // BLOCK_ROWS)[:, None], where // 2]
        return (byte >> (4 * (where % 2)).to(torch.uint8)) & 15

    def codes(self, layer) -> torch.Tensor:
        """The codes back: multiply the identity (exact in fp32) and undo scale and offset."""
        k = layer.in_features
        eye = torch.eye(k, dtype=torch.float32)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.w_packed, self.gk, self.scale_zero32).t()
        scale = self.scale_zero32[..., 0].t().repeat_interleave(self.gk, 1)
        offset = self.scale_zero32[..., 1].t().repeat_interleave(self.gk, 1)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        return ((w - offset) / safe + 8).round().clamp(0, 15).to(torch.uint8)


BLOCK_ROWS = 32  # the packed layout keeps each block of 32 output rows to itself


def block_nibble_map(in_features: int) -> torch.Tensor:
    """int64 [32, in]: where (row i, column c) of a 32-row block sits in that block's packed
    bytes, as nibble position 2 * byte + (1 for the high nibble). Found by packing probe blocks
    whose codes spell each position's index in base 16, one digit per probe, so it follows the
    op's layout rather than re-deriving it."""
    n = BLOCK_ROWS * in_features
    index = torch.arange(n, dtype=torch.int64).view(BLOCK_ROWS, in_features)
    source = torch.zeros(n, dtype=torch.int64)
    digit = 0
    while 16**digit < n:
        probe = ((index >> (4 * digit)) & 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, INNER_K_TILES)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(-1).to(torch.int64)
        source |= nibbles << (4 * digit)
        digit += 1
    position = torch.empty(n, dtype=torch.int64)
    position[source] = torch.arange(n, dtype=torch.int64)
    return position.view(BLOCK_ROWS, in_features)
