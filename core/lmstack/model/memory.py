"""What a loaded model holds in memory: `resident_weight_bytes` (every tensor the model keeps,
each storage once), and `measure_weights`, which builds a stack's model as the engine does (its
quantizer's linears, the weights streamed in, `process_model`) in this process, without a KV
cache, for `lmstack check --memory`. `benchmarks/e2e/quant_cpu.py` reports the same counter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor


def held_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors a module's plain attributes hold, and those of the objects and containers
    they hold (a kernel object's copies), a few levels down; sub-modules are walked on their own."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 3 or isinstance(obj, nn.Module):
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from held_tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from held_tensors(value, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from held_tensors(value, depth + 1)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor `model` holds: parameters, buffers and what its modules keep beside
    them (a kernel's re-laid copy, scale tables, a bf16 copy for batches), each storage once (a
    tied head counts once)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                tensors.extend(held_tensors(value, 1))
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:  # tied tensors, views
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def stored_bytes(tensor: CheckpointTensor) -> int:
    """Bytes of a checkpoint tensor as the file stores it."""
    if isinstance(tensor, GGUFTensor):
        return int(tensor.data.nbytes)
    return tensor.numel() * tensor.element_size()


@dataclass
class WeightMemory:
    """A model as it will run: `resident_bytes` (`resident_weight_bytes`), the checkpoint's
    `weights` (values of every tensor it loaded) and `file_bytes` (their stored bytes), and what
    the quantizer reports dequantizing at load (type -> bytes beyond the file's)."""

    resident_bytes: int
    weights: int
    file_bytes: int
    dequantized: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_weight(self) -> float:
        return self.resident_bytes / max(1, self.weights)


class _Counted:
    """Checkpoint tensors passed through, their values and stored bytes summed."""

    def __init__(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        self.weights, self.values, self.bytes = weights, 0, 0

    def __iter__(self) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in self.weights:
            n = 1
            for d in tensor.shape:
                n *= int(d)
            self.values += n
            self.bytes += stored_bytes(tensor)
            yield name, tensor


def measure_weights(
    source: Any, config: Any, quantizer: Any, *, dtype: torch.dtype, max_positions: int
) -> WeightMemory:
    """Build `source`'s model (a `lmstack.model.source.ModelSource`) on the CPU as the engine's
    model runner does — `quantizer`'s linears, its `prepare_model` hook if any, the weights,
    `process_model` — and measure it. One process: under tensor parallelism a rank would hold
    its share. The quantizer's `dequantized_at_load()`, where it has one, names the checkpoint
    types it could not keep as stored."""
    with torch.device("cpu"):
        model = source.architecture.build(
            config, quantizer.linear_factory(), dtype=dtype, max_positions=max_positions
        )
    prepare = getattr(quantizer, "prepare_model", None)
    if prepare is not None:
        prepare(model)
    counted = _Counted(source.weights())
    model.load_weights(counted)
    quantizer.process_model(model)
    report = getattr(quantizer, "dequantized_at_load", None)
    return WeightMemory(
        resident_bytes=resident_weight_bytes(model),
        weights=counted.values,
        file_bytes=counted.bytes,
        dequantized=dict(report()) if report is not None else {},
    )
