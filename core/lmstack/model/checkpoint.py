"""Checkpoint tensors as they are stored, before a weight loader decides what to do with them.

A `ModelSource` yields `(name, CheckpointTensor)` pairs one at a time. A safetensors tensor is a
`torch.Tensor` in its stored dtype (bf16 stays bf16); a GGUF tensor is a `GGUFTensor` holding the
file's packed bytes and their GGML type. Only a weight loader turns either into a dense tensor
(`to_dense`), so a quantizer can keep packed data packed and a parallel layout can read only its
rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor, still in the file's encoding.

    `data` is what the GGUF reader gives: a (usually read-only, memory-mapped) array whose first
    axis is the tensor's first logical axis (rows). For quantized types it is uint8
    [rows, bytes_per_row]; for F32 / F16 / BF16 it is typed [rows, cols]. GGUF quant blocks run
    along a row, so any selection of whole rows of `data` is again a valid packed tensor.
    `shape` is the logical row-major shape (GGUF lists dimensions innermost first; this is
    reversed).
    """

    data: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]

    @property
    def is_quantized(self) -> bool:
        return self.ggml_type not in (
            GGMLQuantizationType.F32,
            GGMLQuantizationType.F16,
            GGMLQuantizationType.BF16,
        )

    @property
    def block_size(self) -> tuple[int, int]:
        """(values per block, bytes per block) of the GGML type; (1, itemsize) when unquantized."""
        return GGML_QUANT_SIZES[self.ggml_type]

    def raw(self) -> torch.Tensor:
        """The stored bytes as uint8 [rows, bytes_per_row] ([bytes] for a 1-D tensor), copied out
        of the file mapping so the result is writable and outlives the reader."""
        arr = np.ascontiguousarray(self.data).view(np.uint8)
        if len(self.shape) > 1:
            arr = arr.reshape(self.shape[0], -1)
        return torch.from_numpy(arr.copy())

    def take_rows(self, index: torch.Tensor | np.ndarray | slice) -> GGUFTensor:
        """The tensor made of the rows `index` selects (along the first logical axis), still packed.
        A parallel layout takes its shard this way; the Q/K unpermute uses it too."""
        idx = index.numpy() if isinstance(index, torch.Tensor) else index
        data = self.data[idx]
        return GGUFTensor(data=data, ggml_type=self.ggml_type, shape=(int(data.shape[0]), *self.shape[1:]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A dense tensor of `shape` in `dtype`, decoded on the CPU (quant types through fp32)."""
        arr = _gguf_dequantize(self.data, self.ggml_type)
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        elif not arr.flags.writeable:
            # F32 data is a view of the read-only file mapping; torch wants writable memory.
            arr = arr.copy()
        return torch.from_numpy(arr).reshape(self.shape).to(dtype)

    def __repr__(self) -> str:
        return f"GGUFTensor({self.ggml_type.name}, shape={self.shape})"


CheckpointTensor = torch.Tensor | GGUFTensor
"""A tensor as the checkpoint stores it: a dense tensor in its stored dtype, or packed GGUF data."""


def to_dense(tensor: CheckpointTensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` decoded into `dtype`. A dense tensor already in `dtype` comes back as is (no copy);
    non-floating tensors keep their dtype."""
    if isinstance(tensor, GGUFTensor):
        return tensor.dequantize(dtype)
    if not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)
