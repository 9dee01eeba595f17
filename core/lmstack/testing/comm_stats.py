"""Bytes each rank moves through torch.distributed, per operation — measured, for
`benchmarks/e2e/parallel.py`.

Off unless ``LMSTACK_COMM_STATS=1`` is in the environment when a rank starts (spawned workers and
torchrun ranks inherit it): then the torch.distributed functions below are wrapped in that
process, so every caller (lmstack.exec.distributed's helpers, a plugin calling torch directly, the
executor's command broadcast) is counted. Counted per call: the bytes of the tensor this rank
contributes (all-reduce: the tensor; all-gather / all-to-all / reduce-scatter: its input;
broadcast: the tensor, sent or received; send / recv: the tensor). Object collectives
(`broadcast_object_list`, `gather_object`) show up as the broadcasts / gathers they make.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

ENV = "LMSTACK_COMM_STATS"

# op name -> which positional argument (or keyword) holds the tensor this rank contributes
_CONTRIBUTED: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all": (1, "input_tensor_list"),
    "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
}

_counts: dict[str, list[int]] = {}  # op -> [calls, bytes]
_originals: dict[tuple[Any, str], Callable] = {}  # (module, name) -> the function wrapped


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _wrap(name: str, fn: Callable, where: tuple[int, str]) -> Callable:
    index, keyword = where

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        value = args[index] if len(args) > index else kwargs.get(keyword)
        entry = _counts.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += _nbytes(value)
        return fn(*args, **kwargs)

    counted.__lmstack_counted__ = True  # type: ignore[attr-defined]
    return counted


def install() -> None:
    """Wrap the torch.distributed collectives in this process (idempotent)."""
    if _originals:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name, where in _CONTRIBUTED.items():
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        counted = _wrap(name, fn, where)
        # Both names: torch's own object collectives call the c10d module's globals.
        for module in (c10d, dist):
            if getattr(module, name, None) is fn:
                _originals[(module, name)] = fn
                setattr(module, name, counted)


def uninstall() -> None:
    """Put the original functions back (tests)."""
    for (module, name), fn in _originals.items():
        setattr(module, name, fn)
    _originals.clear()


def install_if_enabled() -> None:
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        install()


def snapshot() -> dict[str, dict[str, int]]:
    """{op: {"calls": n, "bytes": b}} since the last reset."""
    return {op: {"calls": c, "bytes": b} for op, (c, b) in sorted(_counts.items())}


def reset() -> None:
    _counts.clear()
