"""The reference linear layer: dense weights in the serving dtype, filled by weight loaders."""

from __future__ import annotations

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.weight_loader import default_weight_loader, set_weight_loader, shard_loader


class Linear(nn.Linear):
    """`nn.Linear` without random initialisation: every value comes from the checkpoint, and
    skipping init keeps untouched pages out of the resident set until the loader writes them."""

    def reset_parameters(self) -> None:
        pass


def default_linear(spec: LinearSpec) -> nn.Module:
    """A dense `Linear` of `spec`'s shape and dtype; a fused projection's weight and bias take
    their parts (`spec.output_sizes`) one checkpoint tensor at a time. Under tensor parallelism
    (`spec.tp_size` > 1) it holds this rank's shard (`spec.shard`) and its loaders cut that
    shard out of the whole checkpoint tensors."""
    layer = Linear(spec.local_in_features, spec.local_out_features, bias=spec.bias, dtype=spec.params_dtype)
    layer.weight.requires_grad_(False)
    num_shards = len(spec.output_sizes)
    set_weight_loader(layer.weight, shard_loader(spec.shard), num_shards=num_shards)
    if layer.bias is not None:
        layer.bias.requires_grad_(False)
        set_weight_loader(layer.bias, shard_loader(spec.shard, bias=True), num_shards=num_shards)
    return layer


def dense_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter with the default loader (embeddings, norms)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    return set_weight_loader(param, default_weight_loader)
