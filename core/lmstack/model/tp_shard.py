"""Where a checkpoint tensor's rows and columns land in a tensor-parallel linear's local shard:
plugin API 1.1's functions, kept as spellings of `lmstack.model.shard.Shard` (which a layer
reads as `spec.shard`; `lmstack.model.quantized_linear.QuantizedLinear` builds on it).

Units are the whole layer's output rows and input columns; a packed format converts them to
its own (packed columns, scale groups) with `Shard.column_slice`.
"""

from __future__ import annotations

import torch

from lmstack.interfaces import LinearSpec


def part_rows(spec: LinearSpec, shard_id: int | None) -> tuple[int, int, int]:
    """(offset in the local output, first row of the checkpoint part, local row count) of part
    `shard_id` (None: a layer of one part): `Shard.part`."""
    part = spec.shard.part(shard_id or 0)
    return part.offset, part.start, part.rows


def input_columns(spec: LinearSpec) -> tuple[int, int]:
    """(first input column, count) this rank keeps: `Shard.columns`."""
    cols = spec.shard.columns
    return cols.start, cols.stop - cols.start


def keeps_bias(spec: LinearSpec) -> bool:
    """Whether this rank adds the bias: `Shard.keeps_bias`."""
    return spec.shard.keeps_bias


def bias_rows(spec: LinearSpec, bias: torch.Tensor, size: int, start: int, rows: int) -> torch.Tensor:
    """This rank's rows [start, start + rows) of one part's whole bias (`size` values), or zeros
    where another rank adds the bias (`keeps_bias`); ValueError on a wrong shape."""
    if tuple(bias.shape) != (size,):
        raise ValueError(f"expected shape {(size,)}, got {tuple(bias.shape)}")
    return bias[start : start + rows] if keeps_bias(spec) else torch.zeros(rows, dtype=bias.dtype)
