"""The `gguf` quantizer: linears keep the checkpoint's GGUF blocks; the embedding and tied LM
head become Q8_0 blocks where that is exact (`lm_head: blocks`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.quant_format import GGUF, checkpoint_format_id
from lmstack_gguf.head import keep_embedding_and_head_as_blocks
from lmstack_gguf.kernel import QK
from lmstack_gguf.linear import GGUFLinear


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
        self.dense_copy = options.prefill == "dense-copy"
        self.int8_activations = options.activations == "int8"

    def linear_factory(self) -> LinearFactory:
        def make(spec: LinearSpec) -> nn.Module:
            return GGUFLinear(spec, self.use_native, self.dense_copy, int8_activations=self.int8_activations)

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
