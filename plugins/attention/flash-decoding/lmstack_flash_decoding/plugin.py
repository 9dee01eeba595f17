"""Registers attention component `flash-decoding`: what it supports, its options, its check.

Imported whenever lmstack loads plugins, so it does not import Triton; the kernel module is
imported when a stack actually builds the component.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.kernels.triton_support import (
    capabilities_with_interpreter,
    cuda_device_conflict,
    interpreter_opt_in,
)
from lmstack.registry import Component

NAME = "flash-decoding"

# Kept in step with lmstack_flash_decoding.kernel (not imported here: it imports Triton).
CAPABILITIES: dict[str, Any] = {
    "devices": ("cuda",),
    "dtypes": ("float32", "float16", "bfloat16"),
    # float8: a scaled cache (k_scale / v_scale per KV head), dequantized in the kernel.
    "kv_cache_dtypes": ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    "head_dims": (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256),
    "block_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "phases": ("decode",),
    "sliding_window": True,  # a window per call: per-layer windows (Gemma) work
    # tanh soft-capping of the scores (Gemma 2), in the kernel's score tile.
    "logit_softcap": True,
}


class FlashDecodingOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Run the kernels in the Triton interpreter (NumPy, on the CPU): for tests on machines
    # without a GPU, never for serving. TRITON_INTERPRET=1 in the environment does the same.
    interpret: Annotated[
        bool, msgspec.Meta(description="run the Triton kernels in the interpreter on the CPU (tests only)")
    ] = False
    # KV splits per sequence; unset: chosen per step from the context length and the SM count.
    num_splits: (
        Annotated[int, msgspec.Meta(ge=1, le=128, description="KV splits per sequence (null: per step)")]
        | None
    ) = None


def capabilities_for(options: FlashDecodingOptions) -> Mapping[str, Any]:
    return capabilities_with_interpreter(CAPABILITIES, options.interpret)


def check(options: FlashDecodingOptions, stack, key: str) -> str | None:
    return cuda_device_conflict(NAME, options.interpret, stack, key)


def build(options: FlashDecodingOptions, ctx):
    from lmstack_flash_decoding.backend import FlashDecoding

    return FlashDecoding(interpret=interpreter_opt_in(options.interpret), num_splits=options.num_splits)


COMPONENT = Component(
    name=NAME,
    kind="attention",
    factory=build,
    options_type=FlashDecodingOptions,
    capabilities=CAPABILITIES,
    capabilities_for=capabilities_for,
    check=check,
    api=">=1.0,<2",  # the lmstack plugin APIs it is written against (lmstack.plugin_api)
    description="FlashDecoding in Triton: split-KV paged decode with a log-sum-exp merge, GQA-grouped.",
)


@hookimpl
def lmstack_register_attention(register) -> None:
    register(COMPONENT)
