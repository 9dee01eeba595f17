"""Quantizers `rtn-int4` (quantize a dense / GGUF checkpoint at load) and `awq` (serve an int4
checkpoint: compressed-tensors pack-quantized or AutoAWQ GEMM). Both build `Int4Linear`s that
keep the weights packed, and both write `Int4WeightFormat` checkpoints."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.model.linear import default_linear
from lmstack.quant.formats import (
    AUTOAWQ_GEMM,
    CT_PACK_QUANTIZED,
    DENSE,
    GGUF,
    WeightFormat,
    checkpoint_format_id,
)
from lmstack_awq.compact import compact_embedding_and_head
from lmstack_awq.int4_format import Int4WeightFormat, ct_scheme
from lmstack_awq.int4_math import Int4Scheme
from lmstack_awq.linear import Int4Linear, Source

# Our fused module -> the Hugging Face modules whose tensors it stacks (names in `ignore` lists).
_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
_LAYER = re.compile(r"layers\.(\d+)\.(\w+)")

# The default for the LM head / embedding: int4 in groups of 32 keeps SmolLM2-135M under 0.3x
# its bf16 bytes (int8 rows do not: 0.31x); see the README's measurements.
DEFAULT_HEAD_GROUP = 32


def hf_module_names(spec: LinearSpec) -> tuple[str, ...]:
    """`layers.3.qkv_proj` -> ("model.layers.3.self_attn.q_proj", ...)."""
    m = _LAYER.fullmatch(spec.name)
    if not m or m.group(2) not in _PARTS:
        return (spec.name,)
    layer, module = m.groups()
    return tuple(f"model.layers.{layer}.{part}" for part in _PARTS[module])


def ignored(name: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' `ignore` list (names, or "re:" patterns) covers module `name`."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name) or re.fullmatch(entry[3:], name.removeprefix("model.")):
                return True
        elif entry in (name, name.removeprefix("model.")):
            return True
    return False


class Int4Quantizer(Quantizer):
    method = "int4"

    def __init__(self, options: Any, ctx: Any) -> None:
        self.options = options
        self.model_config = getattr(ctx, "model_config", None)
        quantization = self.model_config.quantization if self.model_config is not None else None
        self.checkpoint_format = checkpoint_format_id(quantization)
        self.scheme, self.source, self.ignore = self.read_checkpoint(quantization or {})

    def read_checkpoint(self, quantization: dict[str, Any]) -> tuple[Int4Scheme, Source, list[str]]:
        raise NotImplementedError

    def linear_factory(self) -> LinearFactory:
        def make(spec: LinearSpec) -> nn.Module:
            names = hf_module_names(spec)
            skipped = [ignored(n, self.ignore) for n in names]
            if all(skipped):
                return default_linear(spec)
            if any(skipped):
                raise ConfigError(
                    f"the checkpoint quantizes only some of {', '.join(names)} (ignore list), "
                    f"which lmstack serves as one fused {spec.name}"
                )
            try:
                return Int4Linear(spec, self.scheme, self.source)
            except ValueError as e:
                raise ConfigError(str(e)) from e

        return make

    def process_model(self, model: nn.Module) -> None:
        compact_embedding_and_head(model, self.options.lm_head, self.options.lm_head_group_size)
        exact = self.options.fp32_activations == "exact"
        int8 = self.options.fp32_activations == "int8"
        for module in model.modules():
            if isinstance(module, Int4Linear):
                module.exact_fp32 = exact
                module.int8_activations = int8
                module.bf16_copy = self.options.cpu_bf16_copy
                module.prepare()  # kernel re-layouts at load, not on the first request

    def shard_alignment(self, spec: LinearSpec) -> int:
        # Row splits must fall on group boundaries; column splits may cut anywhere (zero points
        # are decoded per row before the split).
        return self.scheme.effective_group(spec.in_features) if spec.parallel == "row" else 1

    def weight_format(self) -> WeightFormat:
        return Int4WeightFormat(self.method, self.scheme)


class RtnInt4Quantizer(Int4Quantizer):
    method = "rtn-int4"

    def read_checkpoint(self, quantization):
        if self.checkpoint_format not in (DENSE, GGUF):
            raise ConfigError(
                f"rtn-int4 quantizes dense or GGUF checkpoints at load; this checkpoint is "
                f"{self.checkpoint_format} (use quant.weights: auto)"
            )
        if self.options.group_size < 0 or self.options.group_size % 8:
            raise ConfigError(f"rtn-int4 group_size {self.options.group_size}: want 0 or a multiple of 8")
        return Int4Scheme(self.options.group_size, self.options.symmetric), "dense", []


class AwqQuantizer(Int4Quantizer):
    method = "awq"

    def read_checkpoint(self, quantization):
        fmt = self.checkpoint_format
        if fmt == CT_PACK_QUANTIZED:
            return ct_scheme(quantization), "ct", list(quantization.get("ignore") or [])
        if fmt == AUTOAWQ_GEMM:
            bits, group = (
                int(quantization.get("bits", quantization.get("w_bit", 4))),
                quantization.get("group_size", quantization.get("q_group_size", 128)),
            )
            if bits != 4:
                raise ConfigError(f"AutoAWQ checkpoint with {bits}-bit weights; awq serves 4-bit")
            if not quantization.get("zero_point", True):
                raise ConfigError(
                    "AutoAWQ checkpoint without zero points (zero_point: false) is not supported"
                )
            ignore = list(quantization.get("modules_to_not_convert") or [])
            return Int4Scheme(int(group), symmetric=False), "autoawq", ignore
        if fmt in (DENSE, GGUF):
            # `lmstack quantize --method awq` builds this quantizer on the dense model it
            # calibrates on: its weight format is what counts there, not its loaders.
            return Int4Scheme(128, symmetric=False), "dense", []
        raise ConfigError(
            f"awq reads compressed-tensors pack-quantized int4 and AutoAWQ GEMM checkpoints; this one is {fmt}"
        )

    def weight_format(self) -> WeightFormat:
        from lmstack_awq.search import AWQConfig, AwqWeightFormat  # the AWQ search runs before encoding

        if self.options.tune_epochs < 0:
            raise ConfigError(f"awq tune_epochs {self.options.tune_epochs}: want 0 (no tuning) or more")

        return AwqWeightFormat(
            self.scheme,
            AWQConfig(
                gptq=self.options.rounding == "gptq",
                bias_correction=self.options.bias_correction,
                tune_epochs=self.options.tune_epochs,
            ),
        )
