"""Reused work buffers for kernels that rebuild a weight per call (a quantizer dequantizing a
layer in slabs before a dense matmul)."""

from __future__ import annotations

import threading

import torch

_scratch = threading.local()


def reused_buffer(
    rows: int, cols: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A [rows, cols] buffer reused across calls: one per thread, dtype, device and inference
    mode (a tensor made under inference mode cannot be written outside it), grown as needed. A
    fresh allocation of a layer-sized buffer costs page faults on every call, more than the
    dequantization that fills it. Its contents are the caller's until its next call."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (dtype, torch.device(device), torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < rows * cols:
        buf = buffers[key] = torch.empty(rows * cols, dtype=dtype, device=device)
    return buf[: rows * cols].view(rows, cols)


def held_bytes() -> int:
    """Bytes of this thread's reused buffers (what benchmarks report beside the weights)."""
    buffers = _scratch.__dict__.get("buffers", {})
    return sum(b.numel() * b.element_size() for b in buffers.values())
