"""Registers the `int8` quantizer: options, capabilities, factory.

Imported whenever lmstack loads plugins; the quantizer module is imported when a stack builds one.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.quant.formats import DENSE, GGUF
from lmstack.registry import Component


class Int8Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The embedding / LM head after loading: int8 rows (one copy when tied; the default, the
    # only way SmolLM2-135M reads <= 1 byte per weight) or dense (the serving dtype).
    lm_head: Annotated[
        Literal["int8", "dense"],
        msgspec.Meta(
            description="embedding / LM head after loading: int8 rows, or dense (the serving dtype)"
        ),
    ] = "int8"
    # fp32 stacks on the CPU: decode-sized batches run the int8 op in bf16 and return fp32
    # ("bf16", fast: the op's fp32 path is 5-40x slower), or every batch dequantizes the weight
    # and multiplies in fp32 ("exact": what the dequantized model computes). README.
    fp32_activations: Annotated[
        Literal["bf16", "exact"],
        msgspec.Meta(description="fp32 CPU stacks: decode batches in bf16 (fast), or exact fp32"),
    ] = "bf16"
    # "auto": fp32 decode batches run this plugin's C++ kernel (fp32 throughout, so both
    # fp32_activations settings get it) where it builds; "torch": torch's ops only (A/B).
    kernel: Annotated[
        Literal["auto", "torch"],
        msgspec.Meta(
            description="auto: fp32 decode batches run this plugin's C++ kernel; torch: torch's ops"
        ),
    ] = "auto"
    # What the C++ kernel multiplies the int8 rows by: "fp32" activations (the dequantized
    # weights' result up to summation order; batches up to 32 rows) or "int8": each 32 values of
    # x rounded to int8 with one scale, integer dot products (llama.cpp's way; batches up to 128
    # rows; on an AVX2 CPU 0.77-1.03x the fp32 kernel's time at one row, 0.81-0.93x at 2-8, +0.42 %
    # perplexity). README.
    activations: Annotated[
        Literal["fp32", "int8"],
        msgspec.Meta(description="what the C++ kernel multiplies int8 rows by: fp32, or x rounded to int8"),
    ] = "fp32"


def build(options: Int8Options, ctx: BuildContext):
    from lmstack_int8.quantizer import Int8Quantizer

    return Int8Quantizer(options, ctx)


COMPONENT = Component(
    name="int8",
    kind="quantizer",
    factory=build,
    options_type=Int8Options,
    capabilities={
        "devices": ("cpu", "cuda"),
        "dtypes": ("float32", "float16", "bfloat16"),
        # The C++ kernel multiplies fp32 activations (decode ~1.8x faster than torch's bf16 int8
        # op on a native-bf16 CPU, README); larger batches round to bf16 there themselves.
        "auto_dtypes": {"cpu": "float32"},
        "auto_dtypes_reason": "int8's CPU kernel computes in float32",
        "kv_cache_dtype": None,
        "checkpoint_formats": (DENSE, GGUF),
    },
    api=">=1.0,<2",
    description="int8 weights, one symmetric scale per output row, made at load from a dense or GGUF "
    "checkpoint (LM head and embedding included); torch's int8 CPU matmul, dequantize + matmul elsewhere.",
)


@hookimpl
def lmstack_register_quantizers(register) -> None:
    register(COMPONENT)
