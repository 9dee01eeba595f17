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

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.tp_shard import bias_rows, part_rows

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
    q/k/v or gate/up weight or bias): shard i goes to rows [sum(sizes[:i]), sum(sizes[:i+1]))."""
    sizes = tuple(int(s) for s in output_sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        if not 0 <= shard_id < len(sizes):
            raise ValueError(f"shard {shard_id} out of range for a fused parameter of {len(sizes)} parts")
        target = param.data.narrow(0, offsets[shard_id], sizes[shard_id])
        value = to_dense(loaded, param.dtype)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard_id}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)

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
# keeps its own rows or columns. It cuts before decoding, so a rank converts (and, for packed
# GGUF rows, dequantizes) only its shard: a dense tensor is narrowed as a view, packed GGUF data
# is selected row by row (quant blocks run along a row, so whole rows stay a valid tensor).


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


def column_parallel_loader(output_sizes: Sequence[int], tp_rank: int, tp_size: int) -> WeightLoader:
    """A column-parallel weight or bias: of every part i (`output_sizes[i]` whole rows) this rank
    keeps rows [r * n_i / tp, (r + 1) * n_i / tp); the parameter holds those shards concatenated
    in part order. A whole (unsplit) fused tensor (shard id None) is cut into its parts first."""
    sizes = tuple(int(s) for s in output_sizes)
    local = tuple(n // tp_size for n in sizes)
    offsets = [sum(local[:i]) for i in range(len(sizes))]

    def load_part(param: nn.Parameter, loaded: CheckpointTensor, part: int) -> None:
        shape = tuple(loaded.shape)
        if shape[0] != sizes[part]:
            raise ValueError(f"part {part}: expected {sizes[part]} rows, got shape {shape}")
        value = to_dense(take_rows(loaded, tp_rank * local[part], local[part]), param.dtype)
        target = param.data.narrow(0, offsets[part], local[part])
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"part {part}: expected shard shape {tuple(target.shape)}, got {tuple(value.shape)}"
            )
        target.copy_(value)

    @torch.no_grad()
    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            if not 0 <= shard_id < len(sizes):
                raise ValueError(f"shard {shard_id} out of range for a fused parameter of {len(sizes)} parts")
            load_part(param, loaded, shard_id)
            return
        if len(sizes) == 1:
            load_part(param, loaded, 0)
            return
        if tuple(loaded.shape)[0] != sum(sizes):
            raise ValueError(f"expected {sum(sizes)} rows, got shape {tuple(loaded.shape)}")
        start = 0
        for part, n in enumerate(sizes):
            load_part(param, take_rows(loaded, start, n), part)
            start += n

    return load


def row_parallel_loader(in_features: int, tp_rank: int, tp_size: int, *, bias: bool) -> WeightLoader:
    """A row-parallel weight keeps input columns [r * in / tp, (r + 1) * in / tp). Its bias is
    added once to the sum over ranks, so tp rank 0 keeps it and the others hold zeros."""
    local = in_features // tp_size

    @torch.no_grad()
    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"got shard {shard_id} for a parameter that is not fused")
        if bias:
            if tp_rank == 0:
                default_weight_loader(param, loaded)
            else:
                param.data.zero_()
            return
        if tuple(loaded.shape)[-1] != in_features:
            raise ValueError(f"expected {in_features} input columns, got shape {tuple(loaded.shape)}")
        value = take_columns(loaded, tp_rank * local, local, param.dtype)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"expected shard shape {tuple(param.shape)}, got {tuple(value.shape)}")
        param.data.copy_(value)

    return load


def loaded_parts(
    output_sizes: Sequence[int], loaded: CheckpointTensor, shard_id: ShardId | None
) -> Iterable[tuple[ShardId, CheckpointTensor]]:
    """(part index, that part's whole checkpoint tensor) for what one loader call of a fused
    projection got: the part `shard_id` names, or each part of a whole fused tensor (as some
    checkpoints store qkv / gate_up), still in its stored form."""
    if shard_id is not None or len(output_sizes) == 1:
        yield (shard_id or 0), loaded
        return
    if tuple(loaded.shape)[0] != sum(output_sizes):
        raise ValueError(f"expected {sum(output_sizes)} rows, got shape {tuple(loaded.shape)}")
    start = 0
    for part, n in enumerate(output_sizes):
        yield part, take_rows(loaded, start, n)
        start += n


def load_bias_parts(
    spec: LinearSpec, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None
) -> None:
    """A quantized linear's bias loader (the bias stays dense): each loaded part's rows for this
    rank go to their place in `param`, zeros where another rank adds the bias (`bias_rows`)."""
    for part, tensor in loaded_parts(spec.output_sizes, loaded, shard_id):
        offset, start, rows = part_rows(spec, part)
        value = to_dense(tensor, param.dtype).reshape(-1)
        value = bias_rows(spec, value, spec.output_sizes[part], start, rows)
        param.data[offset : offset + rows] = value.to(param.device)
