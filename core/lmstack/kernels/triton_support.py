"""Shared by plugins whose kernels are written in Triton: where the kernels run (compiled for a
CUDA device, or in the Triton interpreter on the CPU) and the resolution-time check that says so.

The interpreter executes a kernel's Python body with NumPy, one program at a time — slow, and
meant for tests on machines without a GPU. Triton decides once per process, when it is first
imported, which mode its `@triton.jit` functions (its own library functions such as `tl.max`
included) are built in: the interpreter if ``TRITON_INTERPRET=1`` is set then. So the opt-in
(``interpret: true`` on the component, or that variable) switches the whole process, and
must come before anything imports Triton; `enable_interpreter` says so plainly when it is too
late (e.g. `transformers` imports Triton).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

INTERPRET_ENV = "TRITON_INTERPRET"
_TRUE = {"1", "true", "yes", "on", "y"}


def interpret_env() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter (read as Triton reads it)."""
    return os.environ.get(INTERPRET_ENV, "").lower() in _TRUE


def interpreter_opt_in(interpret_option: bool) -> bool:
    return interpret_option or interpret_env()


def enable_interpreter(component: str) -> None:
    """Put this process's Triton in interpreter mode, or raise if it is already compiled-mode."""
    if "triton" not in sys.modules:
        os.environ[INTERPRET_ENV] = "1"
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl_standard.zeros, InterpretedFunction):
        raise RuntimeError(
            f"{component}: the Triton interpreter was asked for (interpret: true), but Triton was "
            f"already imported in compiled mode in this process; start the process with "
            f"{INTERPRET_ENV}=1 instead"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Programs a decode-sized quantized GEMM should launch: about four per SM of an H200 (132 SMs),
# where the best K-split counts of lmstack-awq's and lmstack-nvfp4's sweep landed
# (benchmarks/results/gpu-2026-12-04-h200).
SPLIT_K_TARGET_PROGRAMS = 512


def split_k(tiles: int, k_steps: int) -> int:
    """How many programs should share each output tile's K range: a power of two, doubled while
    the grid (`tiles` output tiles) holds fewer than SPLIT_K_TARGET_PROGRAMS programs and each
    split keeps at least two of the `k_steps` steps. A decode matmul has few output tiles, too
    few to keep every SM streaming the weight."""
    split = 1
    while tiles * split < SPLIT_K_TARGET_PROGRAMS and k_steps // (split * 2) >= 2:
        split *= 2
    return split


def split_k_output(
    length: int, split: int, step: int, m: int, n: int, dtype: Any, device: Any
) -> tuple[int, int, Any]:
    """(per_split, splits, out) for a GEMM whose K range [0, length) is cut into `split` pieces of
    whole `step`s (fewer where the last would be empty): `out` is [m, n] in `dtype` when one
    piece covers K, else an fp32 workspace [splits, m, n] of partial sums for `reduce_splits`."""
    import torch

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    per_split = cdiv(cdiv(length, split), step) * step
    splits = cdiv(length, per_split)
    if splits == 1:
        return per_split, 1, torch.empty(m, n, dtype=dtype, device=device)
    return per_split, splits, torch.empty(splits, m, n, dtype=torch.float32, device=device)


def reduce_splits(out: Any, dtype: Any) -> Any:
    """`split_k_output`'s result in `dtype`: one `sum` over the pieces (deterministic, unlike
    atomics), or the output itself when K was not split."""
    return out if out.dim() == 2 else out.sum(0).to(dtype)


def capabilities_with_interpreter(
    capabilities: Mapping[str, Any], interpret_option: bool
) -> Mapping[str, Any]:
    """A CUDA-only component's capabilities, widened to the CPU when the interpreter is opted into."""
    if interpreter_opt_in(interpret_option):
        return {**capabilities, "devices": (*capabilities["devices"], "cpu")}
    return capabilities


def cuda_device_conflict(name: str, interpret_option: bool, stack: Any, key: str) -> str | None:
    """For `Component.check`: why a Triton kernel cannot run on this stack's device, and the way
    out; None when it can (a CUDA device, or the interpreter opted into)."""
    if stack.device.type == "cuda" or interpreter_opt_in(interpret_option):
        return None
    return (
        f"is a Triton kernel and needs a CUDA device, but the stack sets device: {stack.device}; "
        f"use the reference kernel there ({key}: torch), or, for testing only, opt into the Triton "
        f"interpreter with {key}: {{name: {name}, interpret: true}} or {INTERPRET_ENV}=1"
    )
