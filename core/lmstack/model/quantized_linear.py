"""`QuantizedLinear`: the public base of a quantizer's linear layer.

What every quantized layer does alike lives here, so a format writes only its own encoding:
the layer's tensor-parallel `Shard` and local sizes, parameters that carry a weight loader
for every part of a fused projection, walking what one loader call received part by part
(a part of a fused projection, or a whole fused tensor cut into its parts), and the dense bias
with its loader. Which rows and columns a rank keeps is `lmstack.model.shard`'s arithmetic.

A loader of a row-indexed tensor (codes, per-row scales) typically reads::

    for part, tensor in self.parts(loaded, shard_id):
        ...  # check tensor's shape against part.size, decode or quantize it
        buffer[part.local] = self.shard.cut(value, part)  # this rank's rows and columns

and one of a per-part value (a per-tensor scale) takes `self.part(shard_id)`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor
from lmstack.model.shard import Part
from lmstack.model.weight_loader import (
    ShardId,
    WeightLoader,
    kept_rows,
    loaded_parts,
    set_weight_loader,
    shard_loader,
)


class QuantizedLinear(nn.Module):
    """A linear layer of `spec` holding this rank's shard (`self.shard`): `in_features` /
    `out_features` are the local sizes, and `bias` (None without one) is a dense parameter in
    the serving dtype, loaded by `shard_loader` (zeros on a rank that does not add it)."""

    def __init__(self, spec: LinearSpec) -> None:
        super().__init__()
        self.spec = spec
        self.shard = spec.shard
        self.in_features, self.out_features = self.shard.local_in_features, self.shard.local_out_features
        self.bias: nn.Parameter | None = None
        if spec.bias:
            self.bias = self.loaded_parameter(
                torch.zeros(self.out_features, dtype=spec.params_dtype), shard_loader(self.shard, bias=True)
            )

    def loaded_parameter(self, data: torch.Tensor, loader: WeightLoader) -> nn.Parameter:
        """`data` as a frozen parameter filled by `loader`, which takes one checkpoint tensor per
        part of a fused projection (the completeness check waits for all of them)."""
        param = nn.Parameter(data, requires_grad=False)
        return set_weight_loader(param, loader, num_shards=len(self.spec.output_sizes))

    def parts(
        self, loaded: CheckpointTensor | torch.Tensor, shard_id: ShardId | None
    ) -> Iterator[tuple[Part, CheckpointTensor]]:
        """(part, its whole tensor) for what one loader call received, split along the first
        dimension when it is a whole fused tensor (stored or already decoded)."""
        return loaded_parts(self.shard, loaded, shard_id)

    def part(self, shard_id: ShardId | None) -> Part:
        """The one part a loader call is for, where the tensor cannot be cut into parts by rows
        (a per-part scale): a fused projection's must come one tensor per part."""
        if shard_id is None and len(self.spec.output_sizes) > 1:
            raise ValueError("expected one tensor per part of the fused projection")
        return self.shard.part(shard_id or 0)

    @staticmethod
    def kept_rows(tensor: CheckpointTensor, part: Part) -> CheckpointTensor:
        """This rank's rows of a part's whole tensor, still as stored (cut before decoding)."""
        return kept_rows(tensor, part)
