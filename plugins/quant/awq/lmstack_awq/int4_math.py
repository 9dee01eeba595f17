"""int4 group quantization: the arithmetic every other module of lmstack-awq shares.

A weight [out, in] is cut along its input into groups of `group_size` columns; each (row,
group) has a float `scale` and an integer `zero` in [0, 15], and a value is stored as the
unsigned code `q` in [0, 15] with ``w ~= (q - zero) * scale``. Symmetric schemes fix zero = 8.

The partial last group rule: when `in % group_size != 0` there are ceil(in / group_size) groups
and the last one covers the remaining columns only (its scale is computed from them alone).
SmolLM2's hidden size 576 = 4.5 x 128, so with group 128 the q/k/v/gate/up projections have
four full groups and a half one. compressed-tensors sizes its scales the same way
(ceil(in / group_size) groups), so the writer, the loaders and the kernels agree on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QMAX = 15  # unsigned 4-bit codes 0..15
SYMMETRIC_ZERO = 8


@dataclass(frozen=True)
class Int4Scheme:
    """`group_size` columns share one scale (0: one group per row, i.e. per-channel scales);
    `symmetric`: zero fixed at 8 (scale = max|w| / 7.5, as compressed-tensors computes it)."""

    group_size: int = 128
    symmetric: bool = False

    def groups(self, in_features: int) -> int:
        return num_groups(in_features, self.effective_group(in_features))

    def effective_group(self, in_features: int) -> int:
        return self.group_size if self.group_size > 0 else in_features


def num_groups(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / group_size)


@dataclass
class Int4Quantized:
    """A quantized weight: `q` uint8 [out, in] codes 0..15, `scale` [out, groups] (float),
    `zero` uint8 [out, groups] in 0..15; `group_size` columns per group (the last may be short)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.q, self.scale, self.zero, self.group_size, dtype)


def expand_groups(t: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """[out, groups] -> [out, in]: each group's value repeated over its columns."""
    return t.repeat_interleave(group_size, dim=1)[:, :in_features]


def _pad_to_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (padded [out, groups, group_size], mask of real columns, same shape)."""
    out, cols = weight.shape
    groups = num_groups(cols, group_size)
    pad = groups * group_size - cols
    mask = torch.ones(out, cols, dtype=torch.bool, device=weight.device)
    if pad:
        weight = torch.nn.functional.pad(weight, (0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
    return weight.view(out, groups, group_size), mask.view(out, groups, group_size)


def group_params(
    weight: torch.Tensor, scheme: Int4Scheme, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest (min/max) scales [out, groups] (already rounded to `scale_dtype`, the
    dtype the checkpoint stores, returned as fp32) and zeros uint8 [out, groups] of `weight`."""
    w = weight.float()
    group = scheme.effective_group(w.shape[1])
    grouped, mask = _pad_to_groups(w, group)
    big = torch.finfo(torch.float32).max
    if scheme.symmetric:
        amax = grouped.abs().amax(dim=-1)
        scale = (amax / 7.5).clamp(min=1e-6)
        zero = torch.full_like(scale, SYMMETRIC_ZERO)
        scale = scale.to(scale_dtype).float()
    else:
        # The range always includes 0 (as compressed-tensors' observers do): zero is then
        # exactly representable and a one-valued group is not degenerate.
        wmax = torch.where(mask, grouped, -big).amax(dim=-1).clamp(min=0)
        wmin = torch.where(mask, grouped, big).amin(dim=-1).clamp(max=0)
        scale = ((wmax - wmin) / QMAX).clamp(min=1e-6).to(scale_dtype).float()
        zero = (-wmin / scale).round().clamp(0, QMAX)
    return scale, zero.to(torch.uint8)


def quantize_with(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Codes uint8 [out, in] of `weight` under given group scales / zeros."""
    cols = weight.shape[1]
    s = expand_groups(scale.float(), cols, group_size)
    z = expand_groups(zero.float(), cols, group_size)
    return (weight.float() / s + z).round().clamp(0, QMAX).to(torch.uint8)


def quantize_int4(
    weight: torch.Tensor, scheme: Int4Scheme, scale_dtype: torch.dtype = torch.float16
) -> Int4Quantized:
    """Round-to-nearest int4 of `weight` [out, in]."""
    group = scheme.effective_group(weight.shape[1])
    scale, zero = group_params(weight, scheme, scale_dtype)
    return Int4Quantized(quantize_with(weight, scale, zero, group), scale, zero, group)


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """(q - zero) * scale, [out, in] in `dtype` (computed in fp32)."""
    cols = q.shape[1]
    s = expand_groups(scale.float(), cols, group_size)
    z = expand_groups(zero.float(), cols, group_size)
    return ((q.float() - z) * s).to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] -> uint8 [out, ceil(in / 8) * 4]: column 2j in the low nibble of
    byte j, 2j + 1 in the high one (the bytes of compressed-tensors' little-endian int32 words,
    so `weight_packed.view(torch.uint8)` is this layout); padding columns are code 0."""
    out, cols = q.shape
    padded = math.ceil(cols / 8) * 8
    if padded != cols:
        q = torch.nn.functional.pad(q, (0, padded - cols))
    q = q.view(out, padded // 2, 2)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 codes [out, cols]."""
    out = packed.shape[0]
    both = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return both.view(out, -1)[:, :cols]
