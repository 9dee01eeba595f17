"""The reference linear layer: dense weights in the serving dtype, filled by weight loaders."""

from __future__ import annotations

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.weight_loader import (
    WeightLoader,
    column_parallel_loader,
    default_weight_loader,
    fused_weight_loader,
    row_parallel_loader,
    set_weight_loader,
)


class Linear(nn.Linear):
    """`nn.Linear` without random initialisation: every value comes from the checkpoint, and
    skipping init keeps untouched pages out of the resident set until the loader writes them."""

    def reset_parameters(self) -> None:
        pass


def default_linear(spec: LinearSpec) -> nn.Module:
    """A dense `Linear` of `spec`'s shape and dtype; a fused projection's weight and bias take
    their parts (`spec.output_sizes`) one checkpoint tensor at a time. Under tensor parallelism
    (`spec.tp_size` > 1) it holds this rank's shard (`spec.local_*` sizes) and its loaders cut
    that shard out of the whole checkpoint tensors."""
    layer = Linear(spec.local_in_features, spec.local_out_features, bias=spec.bias, dtype=spec.params_dtype)
    layer.weight.requires_grad_(False)
    num_shards = len(spec.output_sizes)
    weight_loader, bias_loader = _loaders(spec)
    set_weight_loader(layer.weight, weight_loader, num_shards=num_shards)
    if layer.bias is not None:
        layer.bias.requires_grad_(False)
        set_weight_loader(layer.bias, bias_loader, num_shards=num_shards)
    return layer


def _loaders(spec: LinearSpec) -> tuple[WeightLoader, WeightLoader]:
    """(weight loader, bias loader) for `spec`'s layer."""
    if spec.tp_size > 1 and spec.parallel == "column":
        loader = column_parallel_loader(spec.output_sizes, spec.tp_rank, spec.tp_size)
        return loader, loader
    if spec.tp_size > 1 and spec.parallel == "row":
        args = (spec.in_features, spec.tp_rank, spec.tp_size)
        return row_parallel_loader(*args, bias=False), row_parallel_loader(*args, bias=True)
    loader = fused_weight_loader(spec.output_sizes) if len(spec.output_sizes) > 1 else default_weight_loader
    return loader, loader


def dense_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter with the default loader (embeddings, norms)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    return set_weight_loader(param, default_weight_loader)
