"""Registers attention component `cpu-paged`: what it supports, its options, its check.

Imported whenever lmstack loads plugins, so it neither builds nor loads the C++ extension;
resolution of a stack that names the component does (`check`), and refuses the stack with the
build's one-line reason where it cannot be built.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.registry import Component

NAME = "cpu-paged"

CAPABILITIES: dict[str, Any] = {
    "devices": ("cpu",),
    # Queries and outputs; all arithmetic is fp32 (bf16 is widened on load, rounded on store).
    "dtypes": ("float32", "bfloat16"),
    # float8: a scaled cache (k_scale / v_scale per KV head), widened through a 256-entry table.
    "kv_cache_dtypes": ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    "phases": ("prefill", "decode"),
    # A window per call (per layer: Gemma alternates local and global layers).
    "sliding_window": True,
    # tanh soft-capping of the scores (Gemma 2), in the kernel's softmax tile.
    "logit_softcap": True,
    "chunked_context": True,
    # `attention: auto` on a CPU picks it over the torch reference where it builds (README:
    # 2.8-17x faster decode attention, 1.25-1.9x end to end).
    "auto_rank": {"cpu": 10},
}


class CpuPagedOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Code path: "auto" picks AVX-512, else AVX2+FMA, else plain C++, from what the CPU reports.
    isa: Annotated[
        Literal["auto", "avx512", "avx2", "scalar"],
        msgspec.Meta(description="code path (auto: the widest the CPU reports)"),
    ] = "auto"
    # Decode splits a long context over threads only when the batch leaves threads idle, and
    # never into parts shorter than this many keys.
    min_part: Annotated[
        int,
        msgspec.Meta(ge=32, description="fewest keys per thread when decode splits a context"),
    ] = 256


def check(options: CpuPagedOptions, stack, key: str) -> str | None:
    from lmstack_cpu_paged.build import load, load_error

    problem = load_error()
    if problem is not None:
        return f"cannot be used on this machine: {problem}; use {key}: torch"
    if options.isa != "auto":
        have = load().best_isa()
        want = {"scalar": 0, "avx2": 1, "avx512": 2}[options.isa]
        if want > have:
            return f"was asked for isa: {options.isa}, which this CPU does not support; use isa: auto"
    return None


def build(options: CpuPagedOptions, ctx):
    from lmstack_cpu_paged.backend import CpuPagedAttention

    return CpuPagedAttention(isa=options.isa, min_part=options.min_part)


COMPONENT = Component(
    name=NAME,
    kind="attention",
    factory=build,
    options_type=CpuPagedOptions,
    capabilities=CAPABILITIES,
    check=check,
    api=">=1.0,<2",
    description="Paged CPU attention in C++ (OpenMP, AVX2/AVX-512): K/V read in place, GQA-grouped, fp8 cache.",
)


@hookimpl
def lmstack_register_attention(register) -> None:
    register(COMPONENT)
