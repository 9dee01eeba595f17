"""Registers quantizers `awq` and `rtn-int4`: options, capabilities, factories.

Imported whenever lmstack loads plugins, so it imports neither Triton nor compressed-tensors;
the quantizer module is imported when a stack builds one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.quant.formats import AUTOAWQ_GEMM, CT_PACK_QUANTIZED, DENSE, GGUF
from lmstack.registry import Component

HeadMode = Literal["int8", "int4", "dense"]
Fp32Mode = Literal["bf16", "exact", "int8"]
Rounding = Literal["gptq", "nearest"]


class RtnInt4Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    group_size: Annotated[
        int, msgspec.Meta(description="input columns per scale (0: one scale per output row)")
    ] = 128
    symmetric: Annotated[bool, msgspec.Meta(description="int4 codes without a zero point")] = False
    # How the embedding / LM head are held after loading: int4 (groups of lm_head_group_size;
    # the default: the only one that keeps SmolLM2-135M under 0.3x its bf16 bytes), int8 (one
    # scale per row) or dense (the serving dtype).
    lm_head: Annotated[
        HeadMode,
        msgspec.Meta(description="embedding / LM head after loading: int4 groups, int8 rows or dense"),
    ] = "int4"
    lm_head_group_size: Annotated[
        int, msgspec.Meta(description="input columns per scale of an int4 embedding / LM head")
    ] = 32
    # fp32 stacks on the CPU: with lmstack-gguf's kernels built, decode batches (<= 32 rows) run
    # the layers as GGUF Q4_1 blocks in fp32 ("bf16", the default), or with x rounded to int8 per
    # 32 values and integer dot products ("int8": llama.cpp's scheme, ~1.5x faster decode,
    # README); without them, decode-sized batches (< 64 rows) run torch's int4 op in bf16 and
    # return fp32 (the op's fp32 path is ~10x slower). "exact": every batch decodes the weight
    # and multiplies in fp32 (bit-for-bit what the dequantized model computes).
    fp32_activations: Annotated[
        Fp32Mode,
        msgspec.Meta(
            description="fp32 CPU stacks: decode via bf16 / Q4_1 kernels, int8 activations, or exact fp32"
        ),
    ] = "bf16"
    # fp32 stacks on a CPU with native bf16 (AVX-512 BF16, AMX): keep a bfloat16 copy of each
    # layer (2 more bytes a weight) that batches over 16 rows (prefill, many streams) multiply by,
    # instead of rebuilding the layer from its int4 blocks per call (~1.3x that matmul's time).
    cpu_bf16_copy: Annotated[
        bool,
        msgspec.Meta(
            description="keep a bfloat16 copy of each layer for batches over 16 rows (CPUs with native bf16)"
        ),
    ] = False


class AwqOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    lm_head: Annotated[
        HeadMode,
        msgspec.Meta(description="embedding / LM head after loading: int4 groups, int8 rows or dense"),
    ] = "int4"
    lm_head_group_size: Annotated[
        int, msgspec.Meta(description="input columns per scale of an int4 embedding / LM head")
    ] = 32
    fp32_activations: Annotated[
        Fp32Mode,
        msgspec.Meta(
            description="fp32 CPU stacks: decode via bf16 / Q4_1 kernels, int8 activations, or exact fp32"
        ),
    ] = "bf16"
    cpu_bf16_copy: Annotated[
        bool,
        msgspec.Meta(
            description="keep a bfloat16 copy of each layer for batches over 16 rows (CPUs with native bf16)"
        ),
    ] = False
    # `lmstack quantize --method awq` only: after the AWQ scales, clip and round to nearest (the
    # AWQ paper; measured better on held-out text here) or round with GPTQ (error-compensating
    # against the calibration inputs).
    rounding: Annotated[
        Rounding,
        msgspec.Meta(description="quantizing only: after the AWQ scales, round to nearest or with GPTQ"),
    ] = "nearest"
    # `lmstack quantize --method awq` only: after each layer, o_proj and down_proj take the
    # biases that cancel the mean output error of the attention block and the MLP on the
    # calibration inputs (the folder's config then has attention_bias / mlp_bias). Measured on
    # SmolLM2-135M's held-out text: README.
    bias_correction: Annotated[
        bool, msgspec.Meta(description="quantizing only: o_proj / down_proj biases cancel mean output error")
    ] = True
    # `lmstack quantize --method awq` only: after the search, epochs of end-to-end tuning of the
    # group scales and biases (codes frozen) towards the dense model's next-token distributions
    # on the calibration samples; 8 more samples are cut from the calibration text to pick the
    # epoch kept. 0: none. Measured on SmolLM2-135M's held-out text: README.
    tune_epochs: Annotated[
        int, msgspec.Meta(description="quantizing only: epochs tuning group scales and biases end to end")
    ] = 4


def _common_caps(formats: tuple[str, ...], auto: bool) -> dict[str, Any]:
    """`auto`: `quant.weights: auto` may pick it for `formats` (checkpoints it serves as
    published; rtn-int4 would quantize its dense / GGUF ones, so it is only chosen by name)."""
    return {
        "devices": ("cpu", "cuda"),
        "dtypes": ("float32", "float16", "bfloat16"),
        # On the CPU the int4 layers run fastest as GGUF blocks through lmstack-gguf's kernels,
        # which take fp32 activations (kernels/gguf_blocks.py, README).
        "auto_dtypes": {"cpu": "float32"},
        "auto_dtypes_reason": "its CPU int4 kernels take float32 activations",
        "kv_cache_dtype": None,
        "checkpoint_formats": formats,
        **({"auto_rank": {fmt: {"cpu": 10, "cuda": 10} for fmt in formats}} if auto else {}),
    }


def build_rtn(options: RtnInt4Options, ctx):
    from lmstack_awq.quantizer import RtnInt4Quantizer

    return RtnInt4Quantizer(options, ctx)


def build_awq(options: AwqOptions, ctx):
    from lmstack_awq.quantizer import AwqQuantizer

    return AwqQuantizer(options, ctx)


RTN_INT4 = Component(
    name="rtn-int4",
    kind="quantizer",
    factory=build_rtn,
    options_type=RtnInt4Options,
    capabilities=_common_caps((DENSE, GGUF), auto=False),
    api=">=1.0,<2",
    description="Round-to-nearest int4 weights (group scales, zero points) made at load from a dense or GGUF checkpoint, kept packed.",
)

AWQ = Component(
    name="awq",
    kind="quantizer",
    factory=build_awq,
    options_type=AwqOptions,
    capabilities=_common_caps((CT_PACK_QUANTIZED, AUTOAWQ_GEMM), auto=True),
    api=">=1.7,<2",  # `lmstack quantize --method awq` tunes scales (`lmstack_calibrate.scale_tuning`)
    description="int4 AWQ checkpoints (compressed-tensors pack-quantized, AutoAWQ GEMM) served packed: W4A16.",
)


@hookimpl
def lmstack_register_quantizers(register) -> None:
    register(RTN_INT4)
    register(AWQ)
