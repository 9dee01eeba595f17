"""Registers the `nvfp4` quantizer. Imported whenever lmstack loads plugins, so it does not
import Triton (the kernel module is imported when a layer first runs it)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.kernels.triton_support import cuda_device_conflict, interpreter_opt_in
from lmstack.quant.formats import CT_NVFP4, DENSE, GGUF
from lmstack.registry import Component

NAME = "nvfp4"


class Nvfp4Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # auto: the Triton dequantizing GEMM on CUDA, dequantize-per-layer on the CPU.
    kernel: Annotated[
        Literal["auto", "dequant", "triton"],
        msgspec.Meta(
            description="auto: the Triton dequantizing GEMM on CUDA, dequantize per layer on the CPU"
        ),
    ] = "auto"
    # Quantizing a dense / GGUF checkpoint at load: try a few group scales and keep the one with
    # the least squared error (False: plain round-to-nearest from each group's absmax).
    scale_search: Annotated[
        bool, msgspec.Meta(description="quantizing at load: pick each group's scale by least squared error")
    ] = True
    # Run the Triton kernel in the Triton interpreter on the CPU (tests only).
    interpret: Annotated[
        bool, msgspec.Meta(description="run the Triton kernel in the interpreter on the CPU (tests only)")
    ] = False


def check(options: Nvfp4Options, stack, key: str) -> str | None:
    if options.kernel != "triton":
        return None
    return cuda_device_conflict(NAME, options.interpret, stack, key)


def build(options: Nvfp4Options, ctx: BuildContext):
    from lmstack_nvfp4.quantizer import make_quantizer

    quantization = ctx.model_config.quantization if ctx.model_config is not None else None
    interpret = interpreter_opt_in(options.interpret) and options.kernel == "triton"
    return make_quantizer(quantization, ctx.device.type, options.kernel, options.scale_search, interpret)


COMPONENT = Component(
    name=NAME,
    kind="quantizer",
    factory=build,
    options_type=Nvfp4Options,
    capabilities={
        "devices": ("cpu", "cuda"),
        "dtypes": ("float32", "float16", "bfloat16"),
        "kv_cache_dtype": None,
        "checkpoint_formats": (CT_NVFP4, DENSE, GGUF),
        # `quant.weights: auto` for NVFP4 checkpoints, served as published (dense ones it would
        # quantize: only by name).
        "auto_rank": {CT_NVFP4: {"cpu": 10, "cuda": 10}},
    },
    check=check,
    api=">=1.0,<2",
    description="NVFP4 weights (e2m1, e4m3 scales per 16, global fp32 scale); a Triton dequantizing "
    "GEMM on CUDA (no FP4 tensor cores before Blackwell), dequantize-per-layer on the CPU.",
)


@hookimpl
def lmstack_register_quantizers(register) -> None:
    register(COMPONENT)
