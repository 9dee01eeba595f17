"""Registers the `fp8` quantizer."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.quant.formats import CT_FLOAT_QUANTIZED, DENSE, GGUF
from lmstack.registry import Component


class Fp8Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # auto: torch._scaled_mm (W8A8) on CUDA, weight-only dequantize-per-layer on the CPU;
    # emulate: W8A8 arithmetic without an fp8 matmul (the scaled_mm reference). See linear.py.
    kernel: Annotated[
        Literal["auto", "dequant", "scaled_mm", "emulate"],
        msgspec.Meta(description="auto: torch._scaled_mm (W8A8) on CUDA, weight-only dequantize on the CPU"),
    ] = "auto"
    # For a dense / GGUF checkpoint quantized at load: "dynamic" quantizes activations per token
    # where the kernel does (FP8_DYNAMIC, what `lmstack quantize --method fp8` writes), "none"
    # never. A float-quantized checkpoint's own config decides otherwise.
    activations: Annotated[
        Literal["dynamic", "none"],
        msgspec.Meta(description="quantizing at load: fp8 activations per token (dynamic) or never (none)"),
    ] = "dynamic"


def build(options: Fp8Options, ctx: BuildContext):
    from lmstack_fp8.quantizer import make_quantizer

    quantization = ctx.model_config.quantization if ctx.model_config is not None else None
    return make_quantizer(quantization, ctx.device.type, options.kernel, options.activations)


COMPONENT = Component(
    name="fp8",
    kind="quantizer",
    factory=build,
    options_type=Fp8Options,
    capabilities={
        "devices": ("cpu", "cuda"),
        "dtypes": ("float32", "float16", "bfloat16"),
        "kv_cache_dtype": None,
        "checkpoint_formats": (CT_FLOAT_QUANTIZED, DENSE, GGUF),
        # `quant.weights: auto` for FP8 checkpoints, served as published (dense ones it would
        # quantize: only by name).
        "auto_rank": {CT_FLOAT_QUANTIZED: {"cpu": 10, "cuda": 10}},
    },
    api=">=1.0,<2",
    description="FP8 e4m3 weights (per-channel or per-tensor scales), dynamic per-token or static "
    "activation scales; reads compressed-tensors float-quantized checkpoints or quantizes at load.",
)


@hookimpl
def lmstack_register_quantizers(register) -> None:
    register(COMPONENT)
