"""The compressed-tensors float-quantized scheme a checkpoint declares, and the one we write.

Read by hand from config.json's `quantization_config` (importing compressed-tensors pulls in
transformers and Triton, too heavy for serving); `quantization_config()` writes the fields its
`QuantizationConfig` reads back (the interop test checks that it parses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmstack.errors import ConfigError
from lmstack.quant.formats import CT_FLOAT_QUANTIZED, WeightFormat
from lmstack_fp8 import fp8


@dataclass(frozen=True)
class Fp8Scheme:
    per_channel_weights: bool = True  # else one scale per tensor
    # "dynamic": per-token scales computed at run time (FP8_DYNAMIC); "static": a calibrated
    # per-tensor `input_scale` in the checkpoint (FP8); "none": weight-only (activations stay in
    # the model dtype, FP8 W8A16).
    activations: str = "dynamic"


_WEIGHT_STRATEGIES = {"channel": True, "tensor": False}


def parse_scheme(quantization: dict[str, Any]) -> Fp8Scheme:
    """The scheme of a float-quantized checkpoint; a ConfigError naming the field it cannot serve."""
    groups = quantization.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"fp8: quantization_config has {len(groups)} config_groups; fp8 serves exactly one (all linears alike)"
        )
    ((name, group),) = groups.items()
    where = f"fp8: quantization_config.config_groups.{name}"
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ConfigError(
            f"{where}.weights is {weights.get('num_bits')}-bit {weights.get('type')!r}; fp8 reads 8-bit float weights"
        )
    strategy = weights.get("strategy")
    if strategy not in _WEIGHT_STRATEGIES or not weights.get("symmetric", True):
        raise ConfigError(
            f"{where}.weights: strategy {strategy!r} (symmetric={weights.get('symmetric', True)}) is not "
            "served; fp8 reads symmetric 'tensor' or 'channel' weight scales"
        )
    acts = group.get("input_activations")
    if acts is None:
        activations = "none"
    elif (acts.get("num_bits"), acts.get("type")) != (8, "float"):
        raise ConfigError(f"{where}.input_activations: only 8-bit float activations are served")
    elif acts.get("dynamic"):
        if acts.get("strategy") not in ("token", "tensor"):
            raise ConfigError(
                f"{where}.input_activations: dynamic strategy {acts.get('strategy')!r} is not served"
            )
        activations = "dynamic"
    elif acts.get("strategy") == "tensor":
        activations = "static"
    else:
        raise ConfigError(
            f"{where}.input_activations: static strategy {acts.get('strategy')!r} is not served (only 'tensor')"
        )
    for module in quantization.get("ignore") or []:
        if "lm_head" not in module:
            raise ConfigError(
                f"fp8: quantization_config.ignore lists {module!r}; fp8 serves checkpoints whose decoder "
                "linears are all quantized (only lm_head may be left dense)"
            )
    return Fp8Scheme(per_channel_weights=_WEIGHT_STRATEGIES[strategy], activations=activations)


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": strategy,
        "dynamic": dynamic,
    }


class Fp8WeightFormat(WeightFormat):
    """FP8_DYNAMIC: e4m3 weights with per-channel fp32 scales, per-token activation scales at run
    time (nothing to calibrate)."""

    method = "fp8"

    def encode(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = fp8.quantize_weight(weight, per_channel=True)
        return {"weight": q, "weight_scale": scale}

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        q, scale = fp8.quantize_weight(weight, per_channel=True)
        return q.float() * scale

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        return {
            "quant_method": "compressed-tensors",
            "format": CT_FLOAT_QUANTIZED.partition("/")[2],
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": _args("channel", False),
                    "input_activations": _args("token", True),
                    "output_activations": None,
                    "format": CT_FLOAT_QUANTIZED.partition("/")[2],
                }
            },
            "kv_cache_scheme": None,
            "ignore": list(ignore),
        }
