"""Weight loaders: how one checkpoint tensor gets into one model parameter.

Every parameter a model loads from a checkpoint carries a `weight_loader` (as in vLLM)::

    param.weight_loader(param, loaded, shard_id)

`loaded` is a `CheckpointTensor` as stored (see `lmstack.model.checkpoint`); `shard_id` is None
for a whole parameter, or the index into the fused projection's `output_sizes` (q=0, k=1, v=2;
gate=0, up=1) when several checkpoint tensors make one parameter. The default loaders decode
into the parameter's dtype and copy into the right rows; a quantizer's linear may install a
loader that keeps the packed data instead, and a parallel layout one that keeps only its shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.shard import Part, Shard

ShardId = int
"""Index of a checkpoint tensor inside a fused parameter's `output_sizes`."""

WeightLoader = Callable[[nn.Parameter, CheckpointTensor, "ShardId | None"], None]

NameMapping = Callable[[str], "tuple[str, ShardId | None] | None"]
"""Checkpoint tensor name -> (parameter name, shard id), or None for a tensor the model skips."""


def default_weight_loader(
    param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None
) -> None:
    """Decode `loaded` into the parameter's dtype and copy it over the whole parameter."""
    if shard_id is not None:
        raise ValueError(f"got shard {shard_id} for a parameter that is not fused")
    value = to_dense(loaded, param.dtype)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    with torch.no_grad():
        param.data.copy_(value)


def fused_weight_loader(output_sizes: Sequence[int]) -> WeightLoader:
    """A loader for a parameter made of several checkpoint tensors stacked along dim 0 (a fused
    q/k/v or gate/up weight or bias): shard i goes to rows [sum(sizes[:i]), sum(sizes[:i+1])).
    (`shard_loader` of an unsplit layer; the inputs are read off the parameter.)"""

    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        shard = Shard(output_sizes, _param_inputs(param))
        shard_loader(shard, bias=param.dim() == 1)(param, loaded, shard_id)

    return load


def set_weight_loader(param: nn.Parameter, loader: WeightLoader, num_shards: int = 1) -> nn.Parameter:
    """Attach `loader` to `param`; `num_shards` > 1 says how many checkpoint tensors make it (the
    completeness check in `load_named_weights` waits for all of them)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]
    return param


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], name_map: NameMapping
) -> None:
    """Feed each checkpoint tensor to its parameter's loader, one tensor at a time (so at most one
    decoded tensor is alive besides the model), then check that every parameter got all of its
    parts. A checkpoint tensor with no parameter, or a parameter the checkpoint lacks, is a
    ConfigError naming it."""
    params = dict(model.named_parameters())
    received: dict[str, set[ShardId | None]] = {}
    for ckpt_name, tensor in weights:
        target = name_map(ckpt_name)
        if target is None:
            continue
        param_name, shard_id = target
        param = params.get(param_name)
        if param is None:
            raise ConfigError(
                f"checkpoint tensor {ckpt_name!r} maps to {param_name!r}, which the model does not have"
            )
        loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ConfigError(f"checkpoint tensor {ckpt_name!r} -> {param_name}: {e}") from e
        received.setdefault(param_name, set()).add(shard_id)
    missing = []
    for name, param in params.items():
        got = received.get(name, set())
        shards = getattr(param, "num_shards", 1)
        if None in got or (shards > 1 and len(got) == shards) or (shards == 1 and got):
            continue
        missing.append(name if shards == 1 else f"{name} ({len(got)} of {shards} parts)")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"the checkpoint lacks weights for {', '.join(missing[:3])}{more}")


# --- tensor-parallel shards --------------------------------------------------------------------
# A sharded parameter's loader still receives the whole checkpoint tensor (see LinearSpec) and
# keeps its own rows or columns (which ones: `lmstack.model.shard`). It cuts before decoding, so
# a rank converts (and, for packed GGUF rows, dequantizes) only its shard: a dense tensor is
# narrowed as a view, packed GGUF data is selected row by row (quant blocks run along a row, so
# whole rows stay a valid tensor).


def take_rows(tensor: CheckpointTensor, start: int, length: int) -> CheckpointTensor:
    """Rows [start, start + length) of `tensor` (its first axis), still in its stored form."""
    if isinstance(tensor, GGUFTensor):
        return tensor.take_rows(slice(start, start + length))
    return tensor.narrow(0, start, length)


def take_columns(tensor: CheckpointTensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns [start, start + length) of a 2-D `tensor`, decoded into `dtype`. A dense tensor is
    cut before converting. Packed GGUF blocks run along a row: a cut on block boundaries keeps
    those blocks of every row (a valid packed tensor, decoded alone); any other cut decodes the
    whole tensor first."""
    if not isinstance(tensor, GGUFTensor):
        return to_dense(tensor.narrow(-1, start, length), dtype)
    per_block, block_bytes = tensor.block_size
    if len(tensor.shape) == 2 and start % per_block == 0 and length % per_block == 0:
        raw = tensor.data.view(np.uint8).reshape(tensor.shape[0], -1)
        first, count = start // per_block * block_bytes, length // per_block * block_bytes
        cut = raw[:, first : first + count]
        if not tensor.is_quantized:  # F32 / F16 / BF16 rows: back to their element type
            cut = np.ascontiguousarray(cut).view(tensor.data.dtype)
        return GGUFTensor(cut, tensor.ggml_type, (tensor.shape[0], length)).dequantize(dtype)
    return tensor.dequantize(dtype).narrow(-1, start, length)


def loaded_parts(
    shard: Shard, loaded: CheckpointTensor, shard_id: ShardId | None
) -> Iterator[tuple[Part, CheckpointTensor]]:
    """(part, that part's whole checkpoint tensor) for what one loader call of a fused projection
    got: the part `shard_id` names, or each part of a whole fused tensor (as some checkpoints
    store qkv / gate_up), still in its stored form."""
    if shard_id is not None:
        yield shard.part(shard_id), loaded
        return
    if len(shard.parts) == 1:
        yield shard.parts[0], loaded
        return
    rows = sum(shard.output_sizes)
    if tuple(loaded.shape)[0] != rows:
        raise ValueError(f"expected {rows} rows, got shape {tuple(loaded.shape)}")
    for part in shard.parts:
        yield part, take_rows(loaded, part.fused_start, part.size)


def kept_rows(tensor: CheckpointTensor, part: Part) -> CheckpointTensor:
    """This rank's rows of a part's whole tensor, still in its stored form (cut before decoding,
    so a rank converts only its shard)."""
    if part.rows == part.size:
        return tensor
    return take_rows(tensor, part.start, part.rows)


def shard_loader(shard: Shard, *, bias: bool = False) -> WeightLoader:
    """The loader of a dense parameter holding `shard` of a linear layer's weight
    ([local out, local in]) or, with `bias`, of its bias: every part's rows for this rank (and a
    row split's input columns) decoded into the parameter's dtype and copied to their place; a
    bias another rank adds (`Shard.keeps_bias`) is zeros."""

    @torch.no_grad()
    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        for part, tensor in loaded_parts(shard, loaded, shard_id):
            target = param.data[part.local]
            if bias and not shard.keeps_bias:
                target.zero_()
                continue
            want = (part.size,) if bias else (part.size, shard.in_features)
            if tuple(tensor.shape) != want:
                raise ValueError(f"part {part.index}: expected shape {want}, got {tuple(tensor.shape)}")
            mine = kept_rows(tensor, part)
            if shard.splits_columns and not bias:
                cols = shard.columns
                value = take_columns(mine, cols.start, cols.stop - cols.start, param.dtype)
            else:
                value = to_dense(mine, param.dtype)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"part {part.index}: expected shard shape {tuple(target.shape)}, got {tuple(value.shape)}"
                )
            target.copy_(value)

    return load


def _param_inputs(param: nn.Parameter) -> int:
    """The input columns of an unsplit weight: its width (a bias has none)."""
    return int(param.shape[-1]) if param.dim() == 2 else 0


def column_parallel_loader(output_sizes: Sequence[int], tp_rank: int, tp_size: int) -> WeightLoader:
    """`shard_loader` of a column-parallel weight or bias (plugin API 1.1's spelling): a column
    split leaves the inputs whole, so they are read off the parameter."""

    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        shard = Shard(output_sizes, _param_inputs(param), "column", tp_rank, tp_size)
        shard_loader(shard, bias=param.dim() == 1)(param, loaded, shard_id)

    return load


def row_parallel_loader(in_features: int, tp_rank: int, tp_size: int, *, bias: bool) -> WeightLoader:
    """`shard_loader` of a row-parallel weight or bias (plugin API 1.1's spelling): a row split
    keeps every output row, so their count is read off the parameter."""

    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        shard = Shard((int(param.shape[0]),), in_features, "row", tp_rank, tp_size)
        shard_loader(shard, bias=bias)(param, loaded, shard_id)

    return load
