"""The `gguf` quantizer: linears keep the checkpoint's GGUF blocks; the embedding and tied LM
head become Q8_0 blocks where that is exact (`lm_head: blocks`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.hardware import native_bf16_cpu
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.quant_format import GGUF, checkpoint_format_id
from lmstack_gguf.head import keep_embedding_and_head_as_blocks
from lmstack_gguf.kernel import QK
from lmstack_gguf.linear import GGUFLinear

# With the bfloat16 copy, batches from this many rows multiply by it: on a native-bf16 CPU (AMD
# EPYC, AVX-512 BF16) the copy overtook the int8-activation kernel between 16 and 24 rows of a
# decode step's layers (README).
BF16_COPY_MIN_ROWS = 17


def prefill_mode(prefill: str, int8_activations: bool) -> str:
    """`GGUFOptions.prefill` resolved: "auto" becomes "dense-bf16" where the CPU computes
    bfloat16 natively and activations are int8, else "dense-copy"."""
    if prefill != "auto":
        return prefill
    return "dense-bf16" if int8_activations and native_bf16_cpu() else "dense-copy"


class GGUFQuantizer(Quantizer):
    kv_cache_dtype = None

    def __init__(self, options: Any, ctx: Any) -> None:
        self.options = options
        model_config = getattr(ctx, "model_config", None)
        fmt = checkpoint_format_id(model_config.quantization if model_config is not None else None)
        if fmt != GGUF:
            raise ConfigError(
                f"gguf serves GGUF checkpoints as stored; this checkpoint is {fmt} (use quant.weights: auto)"
            )
        self.use_native = options.kernel == "auto"
        self.int8_activations = options.activations == "int8"
        self.prefill = prefill_mode(options.prefill, self.int8_activations)
        self.dense_copy = self.prefill in ("dense-copy", "dense-bf16")

    def linear_factory(self) -> LinearFactory:
        bf16 = self.prefill == "dense-bf16"
        extra = {"copy_dtype": torch.bfloat16, "kernel_max_rows": BF16_COPY_MIN_ROWS - 1} if bf16 else {}

        def make(spec: LinearSpec) -> nn.Module:
            return GGUFLinear(
                spec, self.use_native, self.dense_copy, int8_activations=self.int8_activations, **extra
            )

        return make

    def process_model(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                module.finalize()
        if self.options.lm_head == "blocks":
            keep_embedding_and_head_as_blocks(model, self.use_native, self.int8_activations)

    def shard_alignment(self, spec: LinearSpec) -> int:
        # Blocks run along a row: a split of the input columns (row-parallel) keeps whole blocks.
        return QK if spec.parallel == "row" else 1
