"""The `int8` quantizer: every linear quantized per output row as the checkpoint loads, then
the embedding and LM head (`lm_head: int8`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.quant.formats import DENSE, GGUF, checkpoint_format_id
from lmstack_int8.head import quantize_embedding_and_head
from lmstack_int8.linear import Int8Linear


class Int8Quantizer(Quantizer):
    kv_cache_dtype = None

    def __init__(self, options: Any, ctx: Any) -> None:
        self.options = options
        model_config = getattr(ctx, "model_config", None)
        fmt = checkpoint_format_id(model_config.quantization if model_config is not None else None)
        if fmt not in (DENSE, GGUF):
            raise ConfigError(
                f"int8 quantizes dense or GGUF checkpoints at load; this checkpoint is {fmt} "
                "(use quant.weights: auto)"
            )
        self.exact_fp32 = options.fp32_activations == "exact"
        self.use_native = options.kernel == "auto"
        self.int8_activations = options.activations == "int8"
        if self.int8_activations and not self.use_native:
            raise ConfigError(
                "int8: activations: int8 runs in this plugin's C++ kernel; kernel: torch has none"
            )
        device, dtype = getattr(ctx, "device", None), getattr(ctx, "dtype", None)
        if self.int8_activations and (
            (device is not None and torch.device(device).type != "cpu")
            or (dtype is not None and dtype != torch.float32)
        ):
            raise ConfigError(
                "int8: activations: int8 runs in the C++ kernel for float32 stacks on the CPU; "
                f"this stack is {str(dtype).removeprefix('torch.')} on {device} (use activations: fp32)"
            )
        if self.int8_activations and self.exact_fp32:
            raise ConfigError(
                "int8: activations: int8 rounds decode activations; fp32_activations: exact asks for none (pick one)"
            )

    def linear_factory(self) -> LinearFactory:
        def make(spec: LinearSpec) -> nn.Module:
            return Int8Linear(spec, self.exact_fp32, self.use_native, self.int8_activations)

        return make

    def process_model(self, model: nn.Module) -> None:
        if self.options.lm_head == "int8":
            quantize_embedding_and_head(model, self.exact_fp32, self.use_native, self.int8_activations)

    def shard_alignment(self, spec: LinearSpec) -> int:
        return 1  # one scale per whole output row: splits may fall anywhere
