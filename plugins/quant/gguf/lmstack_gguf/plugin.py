"""Registers the `gguf` quantizer: options, capabilities, factory.

Imported whenever lmstack loads plugins; the kernels are built when a stack first uses it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.quant.formats import GGUF
from lmstack.registry import Component


class GGUFOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The embedding / tied LM head: Q8_0 blocks where they reproduce the table exactly (a GGUF's
    # Q8_0 embedding does), else dense; "dense": always the dense fp32 table.
    lm_head: Annotated[
        Literal["blocks", "dense"],
        msgspec.Meta(description="embedding / tied LM head: Q8_0 blocks where exact, or always dense fp32"),
    ] = "blocks"
    # "auto": decode batches (<= 32 rows) run the C++ kernel where it builds; "torch": every
    # matmul dequantizes and multiplies densely (A/B runs).
    kernel: Annotated[
        Literal["auto", "torch"],
        msgspec.Meta(
            description="auto: decode batches (<= 32 rows) run the C++ kernel; torch: dense dequantize"
        ),
    ] = "auto"
    # Batches the kernel does not take: "panels" (int8 activations): every batch of a decoder
    # layer, and the LM head's (from 6 rows where AVX2 is the widest code), the blocks re-laid
    # out at load in panels of 16 weight rows, so that one instruction multiplies 4 values of x
    # by 16 (AVX-512 VNNI) or 8 (AVX2) rows at once (0.75 more bytes a weight resident; batches
    # of 8-64 rows ~2-4x faster than the block kernel, prefill ~1.5x the bfloat16 copy on a Zen
    # 5, README); "dense-copy" multiplies by an fp32 copy of each layer
    # kept beside its blocks (prefill as fast as `none`'s; 4 more bytes a weight resident; decode
    # still reads the blocks) from 33 rows; "dense-bf16" by a bfloat16 copy (2 bytes a weight), x
    # rounded to bfloat16, from 17 rows (the crossover with the kernel measured on a CPU with
    # native bf16, README); "dequantize" rebuilds the layer in fp32 per call (least memory).
    # "panels+bf16" (opt-in): the panels, and from 256 rows (prefill chunks) a bfloat16 copy, which
    # oneDNN multiplies on AMX tiles ~2x faster than the panels at 512-2048 rows on an Intel Xeon
    # (2 more bytes a weight resident, README); a row then rounds differently in large steps, so
    # the prefix cache, chunking and batch-mates can change greedy tokens.
    # "auto": "panels" where activations are int8 and the kernels run (AVX2 or AVX-512, AMX CPUs
    # too: batch-invariant), else "dense-bf16" where the CPU computes bfloat16 natively
    # (avx512_bf16 / amx_bf16) and activations are int8, else "dense-copy".
    prefill: Annotated[
        Literal["auto", "panels", "panels+bf16", "dense-copy", "dense-bf16", "dequantize"],
        msgspec.Meta(
            description="how batches the kernel does not take multiply (auto: by CPU features; README)"
        ),
    ] = "auto"
    # What the kernel multiplies the blocks by: "int8" (the default): each 32-block of x rounded
    # to int8 first and integer dot products, as llama.cpp always does (batch-1 decode ~1.7x
    # faster in the 4-bit layers, and the panels for prefill; perplexity +0.3 %, README); "fp32"
    # activations: the logits of the dequantized checkpoint.
    activations: Annotated[
        Literal["fp32", "int8"],
        msgspec.Meta(description="what the kernel multiplies blocks by: x rounded to int8 per 32, or fp32"),
    ] = "int8"
    # K-quant / Q5_x layers (no panels, no copy) with int8 activations: batches over 32 rows
    # (prefill) are "slabs", rebuilt a slab at a time in bfloat16 (native-bf16 CPU) or fp32 and
    # multiplied with x unrounded (prefill ~2x faster than the kq kernel on a 2-core Zen 4), or
    # "int8": the kq kernel (or the panels) for every batch, x rounded to int8 as llama.cpp
    # rounds it for every batch (its perplexity, and every row computed alike in any batch:
    # README). "auto": "int8" for the Q4_K / Q5_K / Q6_K layers kept as panels where AVX-512 VNNI
    # runs them (their batched code beats bfloat16 slabs there: a 1536 x 576 Q6_K / Q4_K layer at
    # 256 rows 0.86 vs 1.38 ms, Zen 4), "slabs" for the rest.
    kquant_batches: Annotated[
        Literal["auto", "slabs", "int8"],
        msgspec.Meta(
            description="K-quant layers' batches over 32 rows: bf16/fp32 slabs, the int8 kernel, or auto"
        ),
    ] = "auto"


def build(options: GGUFOptions, ctx: BuildContext):
    from lmstack_gguf.quantizer import GGUFQuantizer

    return GGUFQuantizer(options, ctx)


COMPONENT = Component(
    name="gguf",
    kind="quantizer",
    factory=build,
    options_type=GGUFOptions,
    capabilities={
        "devices": ("cpu",),
        "dtypes": ("float32",),
        # K/V kept in bfloat16 under quant.kv_cache: auto (llama.cpp keeps f16): decode attention
        # reads half the bytes (a batch-32 step's attention -40 %) and twice the sequences fit;
        # SmolLM2's perplexity 22.3456 against fp32 K/V's 22.3455 (README).
        "kv_cache_dtype": "bfloat16",
        "checkpoint_formats": (GGUF,),
        # `quant.weights: auto` on a CPU: the blocks as stored, not dequantized by `none`
        # (0.6 bytes a weight read per token against 4).
        "auto_rank": {GGUF: {"cpu": 20}},
    },
    api=">=1.0,<2",
    description="GGUF Q4_0 / Q4_1 / Q8_0, Q5_0 / Q5_1, K-quant (Q2_K-Q6_K) and F16 / BF16 tensors served as "
    "stored (no dequantization at load), with C++ CPU kernels; the embedding / head too. Other GGUF types "
    "(IQ*, ...) dequantize, with a warning.",
)


@hookimpl
def lmstack_register_quantizers(register) -> None:
    register(COMPONENT)
