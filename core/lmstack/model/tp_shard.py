"""Where a checkpoint tensor's rows and columns land in a tensor-parallel linear's local shard.

Weight loaders receive whole checkpoint tensors (`LinearSpec` docstring); a quantized linear
keeps only its rank's share. These helpers say which share, in units of the whole layer's
output rows and input columns, so a packed format converts them to its own units (packed
columns, scale groups) by dividing by its alignment.
"""

from __future__ import annotations

import torch

from lmstack.interfaces import LinearSpec


def part_rows(spec: LinearSpec, shard_id: int | None) -> tuple[int, int, int]:
    """(offset in the local output, first row of the checkpoint part, local row count) of part
    `shard_id` (None: a layer of one part). A column-parallel rank keeps rows
    [r * part / tp, (r + 1) * part / tp) of every part; other layouts keep whole parts."""
    index = shard_id or 0
    if not 0 <= index < len(spec.output_sizes):
        raise ValueError(f"shard {shard_id} out of range for a linear of {len(spec.output_sizes)} parts")
    local = spec.local_output_sizes
    start = spec.tp_rank * local[index] if spec.parallel == "column" and spec.tp_size > 1 else 0
    return sum(local[:index]), start, local[index]


def input_columns(spec: LinearSpec) -> tuple[int, int]:
    """(first input column, count) this rank keeps: its share of a row-parallel layer's input,
    all of it otherwise."""
    count = spec.local_in_features
    start = spec.tp_rank * count if spec.parallel == "row" and spec.tp_size > 1 else 0
    return start, count


def keeps_bias(spec: LinearSpec) -> bool:
    """A row-parallel layer's outputs are summed over ranks, so only rank 0 adds the bias."""
    return not (spec.parallel == "row" and spec.tp_size > 1 and spec.tp_rank != 0)


def bias_rows(spec: LinearSpec, bias: torch.Tensor, size: int, start: int, rows: int) -> torch.Tensor:
    """This rank's rows [start, start + rows) of one part's whole bias (`size` values), or zeros
    where another rank adds the bias (`keeps_bias`); ValueError on a wrong shape."""
    if tuple(bias.shape) != (size,):
        raise ValueError(f"expected shape {(size,)}, got {tuple(bias.shape)}")
    return bias[start : start + rows] if keeps_bias(spec) else torch.zeros(rows, dtype=bias.dtype)
