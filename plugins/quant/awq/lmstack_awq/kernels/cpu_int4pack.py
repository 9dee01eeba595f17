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

import functools

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
        # One (scale, offset) table, in the dtype the op multiplies in: the serving dtype, or
        # bf16 for an fp32 model (its few-row calls run in bf16, its many-row ones dequantize
        # from w_scales / w_zeros). An fp32 copy beside it would cost 8 bytes a group: a
        # quarter byte a weight for the g32 head, half of what its codes take.
        dtype = layer.spec.params_dtype
        self.table = self.scale_offset(layer, torch.bfloat16 if dtype == torch.float32 else dtype)

    def scale_offset(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """[in / gk, out, 2] per op group: the scale and offset of the checkpoint group its first
        column belongs to, computed in fp32 and rounded once to `dtype`."""
        k = layer.in_features
        scale = expand_groups(layer.w_scales.float(), k, layer.group_size)[:, :: self.gk]
        zero = expand_groups(layer.w_zeros.float(), k, layer.group_size)[:, :: self.gk]
        return torch.stack([scale.t(), ((8 - zero) * scale).t()], dim=-1).to(dtype).contiguous()

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.shape[0] >= FP32_DEQUANT_MIN_ROWS or layer.exact_fp32:
                return x @ self.dequantized(layer).t()
            return self(layer, x.to(torch.bfloat16)).float()
        # Another half-precision dtype than the table's: a table for this call only.
        sz = self.table if x.dtype == self.table.dtype else self.scale_offset(layer, x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.w_packed, self.gk, sz)

    def layout(self, layer) -> PackedLayout:
        return packed_layout(layer.out_features, layer.in_features)

    def dequantized(self, layer) -> torch.Tensor:
        """The fp32 weight [out, in], decoded from the packed layout (not kept)."""
        from lmstack_awq.int4_math import dequantize_int4

        return dequantize_int4(
            self.codes(layer), layer.w_scales, layer.w_zeros, layer.group_size, torch.float32
        )

    def row_codes(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """uint8 codes [len(ids), in] of output rows `ids`, read straight from the packed layout
        (the embedding lookup of a tied int4 head)."""
        where = self.layout(layer).positions(ids)
        byte = layer.w_packed.view(-1)[where // 2]
        return (byte >> (4 * (where % 2)).to(torch.uint8)) & 15

    def codes(self, layer) -> torch.Tensor:
        """uint8 codes [out, in], read back from the packed layout."""
        return self.layout(layer).unpack(layer.w_packed)


BLOCK_ROWS = 32  # `supports` asks for whole blocks of 32 output rows (what AVX2 builds pack)
# Rows probed to learn the op's layout: its blocks of output rows (32 on AVX2 builds, 64 on
# AVX-512 ones) divide this, so a probe of PROBE_ROWS + n % PROBE_ROWS rows has n's tail.
PROBE_ROWS = 256


def probe_positions(rows: int, in_features: int) -> torch.Tensor:
    """int64 [rows, in]: where (row, column) of a [rows, in] weight sits in the op's packed
    bytes, as nibble position 2 * byte + (1 for the high nibble). Found by packing probe weights
    whose codes spell each position's index in base 16, one digit per probe, so it follows the
    op's layout (which depends on the CPU torch was built for) rather than re-deriving it."""
    n = rows * in_features
    index = torch.arange(n, dtype=torch.int64).view(rows, in_features)
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
    return position.view(rows, in_features)


@functools.cache
def packed_layout(out_features: int, in_features: int) -> PackedLayout:
    """One layout per weight shape, shared by every layer of that shape: its maps take 8 bytes
    a column for each row of a block (~0.8 MB for a [*, 1536] weight), kept once, not per layer."""
    return PackedLayout(out_features, in_features)


class PackedLayout:
    """Where each code of an [out, in] weight sits once packed: blocks of `block` output rows,
    each laid out alike and kept to its own bytes (`block_map`, nibble positions inside a
    block), then the last `out % block` rows as a block of their own (`tail_map`)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        n, k = out_features, in_features
        rows = n if n <= 2 * PROBE_ROWS else PROBE_ROWS + n % PROBE_ROWS
        where = probe_positions(rows, k)
        self.k = k
        self.block = next(
            b for b in (16, 32, 64, 128, 256, rows) if b <= rows and int(where[:b].max()) < b * k
        )
        self.block_map = where[: self.block].contiguous()
        tail = n % self.block
        self.regular_rows = n - tail
        probe_regular = rows - tail
        self.tail_map = (where[probe_regular:] - probe_regular * k).contiguous()
        # The assumption the extrapolation rests on, checked on the probe: every whole block is
        # laid out as the first one.
        blocks = where[:probe_regular].view(-1, self.block, k)
        offsets = torch.arange(blocks.shape[0], dtype=torch.int64).view(-1, 1, 1) * (self.block * k)
        tail_ok = tail == 0 or (int(self.tail_map.min()) >= 0 and int(self.tail_map.max()) < tail * k)
        if not tail_ok or not torch.equal(blocks - offsets, self.block_map.expand_as(blocks)):
            raise RuntimeError(
                "torch's int4 pack layout is not made of like blocks of rows; lmstack-awq cannot read it"
            )

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [len(ids), in]: nibble positions of output rows `ids`."""
        ids = ids.to(torch.int64)
        regular = ids < self.regular_rows
        safe = torch.where(regular, ids, torch.zeros_like(ids))
        inside = self.block_map[safe % self.block] + (safe // self.block * (self.block * self.k))[:, None]
        if self.tail_map.shape[0] == 0:
            return inside
        t = torch.where(regular, torch.zeros_like(ids), ids - self.regular_rows)
        in_tail = self.tail_map[t] + self.regular_rows * self.k
        return torch.where(regular[:, None], inside, in_tail)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 codes [out, in] from the packed bytes: one gather per block kind."""
        flat = packed.view(-1)
        nibbles = torch.stack((flat & 15, flat >> 4), dim=-1).view(-1)
        split = self.regular_rows * self.k
        blocks = nibbles[:split].view(-1, self.block * self.k)
        codes = blocks.index_select(1, self.block_map.view(-1)).view(-1, self.k)
        if self.tail_map.shape[0] == 0:
            return codes
        tail = nibbles[split:].index_select(0, self.tail_map.view(-1)).view(-1, self.k)
        return torch.cat((codes, tail))
