"""What this machine computes well and holds: the `dtype: auto` choice, the CPU thread count,
and the memory `allocator.kv_cache_memory: auto` sizes the KV cache from (`kv_budget`).

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

`LMSTACK_MAX_ISA` caps the vector code: `avx2` makes an AVX-512 machine choose as an AVX2 one
would (no AVX-512 or AMX flag seen here, so `dtype: auto` is float32; every C++ extension's
run-time path AVX2, csrc/isa_cap.h), `scalar` as a CPU without AVX; unset, `auto` or `avx512`:
no cap. For reproducing an older machine's behaviour and for running a whole model through a
lower kernel path; torch's own kernels follow `ATEN_CPU_CAPABILITY`, set apart.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

ISA_CAP_ENV = "LMSTACK_MAX_ISA"
# What each cap hides: the flags of wider vector code than it allows (prefixes).
ISA_CAP_HIDES = {"avx2": ("avx512", "amx"), "scalar": ("avx512", "amx", "avx", "fma", "f16c")}
NO_CAP = ("", "auto", "avx512")


def isa_cap() -> str | None:
    """`LMSTACK_MAX_ISA`: "avx2" or "scalar", None where unset or no cap; ConfigError (one line)
    for any other value (the C++ extensions would silently ignore it)."""
    from lmstack.errors import ConfigError

    value = os.environ.get(ISA_CAP_ENV, "").strip().lower()
    if value in NO_CAP:
        return None
    if value not in ISA_CAP_HIDES:
        raise ConfigError(
            f"{ISA_CAP_ENV}={value!r}: expected one of auto, avx512, avx2, scalar (the widest vector "
            "code lmstack's kernels may use)"
        )
    return value


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as lmstack's choices see them: the hardware's (`hardware_flags`)
    less those above `LMSTACK_MAX_ISA`."""
    cap = isa_cap()
    flags = hardware_flags()
    return flags if cap is None else frozenset(f for f in flags if not f.startswith(ISA_CAP_HIDES[cap]))


@functools.cache
def hardware_flags() -> frozenset[str]:
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
    out: dict[str, object] = {"cpu_model": cpu_name(), "cpu_flags": flags}
    cap = isa_cap()
    if cap is not None:  # the machine's own flags too: a capped run is not that CPU kind
        out["isa_cap"] = cap
        out["hardware_flags"] = sorted(f for f in hardware_flags() if f.startswith(("avx2", "avx512", "amx")))
    return out


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


# ---------------------------------------------------------------------------------------------
# Memory: what `allocator.kv_cache_memory: auto` sizes the KV cache from
# ---------------------------------------------------------------------------------------------

# On a GPU the KV cache takes what is left of this fraction of the device's memory once the
# weights are loaded (vLLM's `gpu_memory_utilization`); the rest is headroom for activations,
# the CUDA context and allocator fragmentation.
GPU_MEMORY_FRACTION = 0.9
# On a CPU (or a device sharing the host's memory) a quarter of the memory available now, and
# never more than 1 GiB: the cache is zero-filled at start (RAM committed up front), and a CPU
# decodes few sequences at a time, so a larger cache would only take memory the rest of the
# machine needs (a laptop would swap).
CPU_MEMORY_FRACTION = 0.25
CPU_KV_CAP = 2**30


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"


def host_available_memory() -> int | None:
    """Bytes of host memory a new allocation can take without swapping: /proc/meminfo's
    MemAvailable, lowered to what the process's cgroup (a container's limit) still allows;
    None where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        available = cgroup if available is None else min(available, cgroup)
    return available


def _cgroup_headroom() -> int | None:
    """cgroup v2 memory.max - memory.current of this process's group, where limited."""
    try:
        rel = Path("/proc/self/cgroup").read_text(encoding="ascii").strip().splitlines()[0].split(":", 2)[2]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text(encoding="ascii").strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text(encoding="ascii")))
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class KVBudget:
    """`kv_cache_memory: auto`: the bytes and the rule that gave them (for `lmstack check`)."""

    bytes: int
    reason: str


def kv_budget_from(device_type: str, free: int | None, total: int | None) -> KVBudget:
    """The rule itself, from measured numbers: on cuda `free` / `total` are the device's (as
    `torch.cuda.mem_get_info` gives them); elsewhere `free` is the host's available memory
    (`total` unused). Unknown memory (None) gives the CPU cap."""
    if device_type == "cuda":
        assert free is not None and total is not None
        in_use = total - free
        budget = int(GPU_MEMORY_FRACTION * total) - in_use
        return KVBudget(
            max(0, budget),
            f"auto on cuda: {GPU_MEMORY_FRACTION:.0%} of the GPU's {_gib(total)} less the {_gib(in_use)} "
            f"in use (by the weights once loaded, and any other process) = {_gib(max(0, budget))}",
        )
    if free is None:
        return KVBudget(
            CPU_KV_CAP, f"auto on {device_type}: available memory unknown, so the cap, {_gib(CPU_KV_CAP)}"
        )
    budget = min(int(CPU_MEMORY_FRACTION * free), CPU_KV_CAP)
    return KVBudget(
        budget,
        f"auto on {device_type}: {CPU_MEMORY_FRACTION:.0%} of the {_gib(free)} available, at most "
        f"{_gib(CPU_KV_CAP)} = {_gib(budget)}",
    )


def kv_budget_reason(device: torch.device) -> str:
    """What `kv_cache_memory: auto` gives on `device` now, for `lmstack check` (the allocator
    measures again once the weights are loaded); the rule alone where the device is not here."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return (
            f"auto on cuda: {GPU_MEMORY_FRACTION:.0%} of the GPU's memory less what is in use once the "
            "weights are loaded (measured there: no CUDA device here)"
        )
    return f"{kv_budget(device).reason} now (measured again once the weights are loaded)"


def kv_budget(device: torch.device) -> KVBudget:
    """`kv_cache_memory: auto` on `device`, measured now (the allocator is built after the
    weights are loaded, so their memory is no longer free then)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return kv_budget_from("cuda", free, total)
    return kv_budget_from(device.type, host_available_memory(), None)
