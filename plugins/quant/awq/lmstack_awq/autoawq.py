"""AutoAWQ GEMM tensors -> codes / zeros / scales in lmstack-awq's [out, in] orientation.

AutoAWQ stores `qweight` int32 [in, out / 8], `qzeros` int32 [groups, out / 8] and `scales`
[groups, out]; within each int32 the eight 4-bit fields (bits 4i..4i+3) hold output columns
in the order 0, 2, 4, 6, 1, 3, 5, 7 of their block of eight (AutoAWQ's GEMM kernel layout).
Codes and zeros are unsigned (0..15); w = (code - zero) * scale.
"""

from __future__ import annotations

import torch

from lmstack_awq.int4_math import num_groups

# Field i of a word holds output column AWQ_ORDER[i] of its block of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> uint8 [rows, cols] in natural column order."""
    rows, n = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    fields = ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [rows, n, 8] by field
    out = torch.empty_like(fields)
    out[..., list(AWQ_ORDER)] = fields
    return out.reshape(rows, n * 8)


def pack_awq_words(values: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_awq_words` (used by tests that write AutoAWQ checkpoints)."""
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    words = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_autoawq(
    name: str, t: torch.Tensor, out: int, in_features: int, group_size: int
) -> tuple[torch.Tensor, int]:
    """One AutoAWQ tensor of a linear part with `out` rows -> ([out, columns], input columns per
    column): codes [out, in] (1), zeros or scales [out, groups] (group_size)."""
    groups = num_groups(in_features, group_size)
    if name == "scales":
        if tuple(t.shape) != (groups, out):
            raise ValueError(f"expected scales [{groups}, {out}] (group {group_size}), got {list(t.shape)}")
        return t.float().t(), group_size
    rows = in_features if name == "qweight" else groups
    if t.dtype != torch.int32 or tuple(t.shape) != (rows, out // 8) or out % 8:
        raise ValueError(f"expected int32 {name} [{rows}, {out // 8}], got {t.dtype} {list(t.shape)}")
    return unpack_awq_words(t).t(), 1 if name == "qweight" else group_size
