"""What this machine computes well: the `dtype: auto` choice and the CPU thread count.

`dtype: auto` (the default) picks, per device:

- CUDA: bfloat16 where the GPU computes it (`torch.cuda.is_bf16_supported`), else float16.
- CPU: bfloat16 only where the CPU has native bf16 arithmetic (the `avx512_bf16` or `amx_bf16`
  flags); elsewhere float32. Without native bf16, torch's bf16 matmul converts on the fly: it is
  faster than fp32 at batch 1 only because it reads half the bytes, and 3-6x slower at 8-32 rows
  (576 x 1536 on a 2-core AVX2 EPYC: fp32 84 / 271 / 558 us at M = 1 / 8 / 32, bf16
  115 / 843 / 3,412 us), so a server that batches is better served in fp32 there. The choice is a
  table keyed by CPU flags, not a start-up probe: it is the same on every start and costs
  nothing.

The flags come from /proc/cpuinfo (Linux); where that cannot be read, no native bf16 is
assumed (float32: slower at batch 1 on a bf16 CPU, never wrong).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_description() -> dict[str, object]:
    """The CPU a measurement ran on, for result files: model name and its vector / matrix flags."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512", "amx")))
    return {"cpu_model": cpu_name(), "cpu_flags": flags}


def native_bf16_cpu() -> bool:
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


@dataclass(frozen=True)
class DtypeChoice:
    """`dtype` and why; `fallbacks`: the next best dtypes on this device, in order (the
    resolver takes the first the stack's components all accept when they refuse `dtype`)."""

    dtype: torch.dtype
    reason: str
    fallbacks: tuple[torch.dtype, ...] = ()


def auto_dtype(device: torch.device) -> DtypeChoice:
    """What `dtype: auto` means on `device`, and why."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    if device.type == "cuda":
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return DtypeChoice(fp16, "auto: this GPU has no bfloat16 arithmetic", (fp32,))
        return DtypeChoice(bf16, "auto: bfloat16 on a GPU", (fp16, fp32))
    if device.type == "cpu":
        if native_bf16_cpu():
            have = ", ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags())
            return DtypeChoice(bf16, f"auto: this CPU computes bfloat16 natively ({have})", (fp32, fp16))
        return DtypeChoice(
            fp32,
            "auto: this CPU has no native bfloat16 (no avx512_bf16 / amx_bf16), where float32 "
            "matmuls are several times faster from 8 rows up",
            (bf16, fp16),
        )
    return DtypeChoice(fp32, f"auto: float32 on {device.type}", (bf16, fp16))


def dtype_warning(device: torch.device, dtype: torch.dtype) -> str | None:
    """A line for `lmstack check` when an explicit dtype is a slow path on this machine."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16_cpu():
        return (
            "dtype: bfloat16 on a CPU without native bfloat16 (no avx512_bf16 / amx_bf16): its "
            "matmuls are emulated and several times slower than float32 from 8 rows up; "
            "dtype: auto picks float32 here"
        )
    return None


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container
    cpuset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
