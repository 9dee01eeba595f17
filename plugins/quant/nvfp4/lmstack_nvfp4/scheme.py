"""The compressed-tensors nvfp4-pack-quantized scheme a checkpoint declares, and the one we write.

Read by hand from config.json's `quantization_config` (importing compressed-tensors pulls in
transformers and Triton); the interop test checks that what `quantization_config()` writes
parses as compressed-tensors' own NVFP4A16 preset.
"""

from __future__ import annotations

from typing import Any

import torch

from lmstack.errors import ConfigError
from lmstack.quant.formats import CT_NVFP4, WeightFormat
from lmstack_calibrate.awq_search import AWQCalibration, AWQConfig
from lmstack_nvfp4 import nvfp4

# Multiples of a group's absmax / 6 scale tried when quantizing; the one with the least squared
# error per group wins. 1.5 maps the group's absmax to e2m1's 4 instead of 6 ("four over six"):
# values near the max then land on 3 / 4 rather than the coarse 4 / 6 steps. Measured on
# SmolLM2 (README): RTN +22.4 % perplexity, {1, 1.5} +16.3 %, {1 ... 1.5} in six steps +19.4 %;
# clipping candidates (< 1) made it worse (+27.2 %): the large weights matter more than the MSE.
SCALE_SEARCH = (1.0, 1.5)


def parse_scheme(quantization: dict[str, Any]) -> bool:
    """Checks an NVFP4 checkpoint's config; True when it quantizes activations too (NVFP4 W4A4:
    it then stores `input_global_scale`, which we read and do not use)."""
    groups = quantization.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"nvfp4: quantization_config has {len(groups)} config_groups; nvfp4 serves exactly one (all linears alike)"
        )
    ((name, group),) = groups.items()
    where = f"nvfp4: quantization_config.config_groups.{name}"
    w = group.get("weights") or {}
    got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True))
    if got != (4, "float", nvfp4.GROUP, True):
        raise ConfigError(
            f"{where}.weights is (bits, type, group_size, symmetric) = {got}; nvfp4 reads (4, 'float', 16, True)"
        )
    for module in quantization.get("ignore") or []:
        if "lm_head" not in module:
            raise ConfigError(
                f"nvfp4: quantization_config.ignore lists {module!r}; nvfp4 serves checkpoints whose decoder "
                "linears are all quantized (only lm_head may be left dense)"
            )
    acts = group.get("input_activations")
    return acts is not None


class Nvfp4WeightFormat(AWQCalibration, WeightFormat):
    """NVFP4A16: e2m1 weights, e4m3 scales per 16 inputs (searched per group), a global fp32
    scale per tensor; activations stay in the model dtype. `Calibrated`: `lmstack quantize
    --method nvfp4` first runs the core's AWQ search against this format (activation-aware
    per-channel scales folded into the previous op, and a clipping search measured on the
    layer's output rather than the weights' squared error); quantizing at load stays plain."""

    method = "nvfp4"
    group_size = nvfp4.GROUP  # what the clipping search groups by

    def __init__(self, search: tuple[float, ...] = SCALE_SEARCH, awq: AWQConfig | None = None) -> None:
        self.search = search
        # NVFP4 is symmetric (no zero point) and has no GPTQ rounding here.
        self.awq = awq or AWQConfig(asymmetric_clip=False, gptq=False)

    def encode(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out, inp = weight.shape
        if inp % nvfp4.GROUP:
            raise ConfigError(
                f"nvfp4: linear {name} has {inp} inputs, not a multiple of {nvfp4.GROUP}; "
                "compressed-tensors' NVFP4 layout needs whole groups of 16"
            )
        packed, scale, gs = nvfp4.quantize(weight, search=self.search)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return nvfp4.fake_quantize(weight, self.search)

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        fmt = CT_NVFP4.partition("/")[2]
        return {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "symmetric": True,
                        "group_size": nvfp4.GROUP,
                        "strategy": "tensor_group",
                        "dynamic": False,
                        "scale_dtype": "torch.float8_e4m3fn",
                    },
                    "input_activations": None,
                    "output_activations": None,
                    "format": fmt,
                }
            },
            "kv_cache_scheme": None,
            "ignore": list(ignore),
        }
