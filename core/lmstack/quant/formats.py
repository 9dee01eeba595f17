"""Quantized checkpoint formats: naming what a checkpoint holds, and writing one.

Reading: `checkpoint_format_id(model_config.quantization)` names the format of the checkpoint
being served ("dense", "gguf", "compressed-tensors/pack-quantized", ...). A quantizer declares
the ids it reads in its capabilities (`checkpoint_formats`); `quant: {weights: auto}` picks the
one that claims the checkpoint, and naming one that cannot read it is a resolution error.

Writing: a quantizer that can produce checkpoints returns a `WeightFormat` from
`Quantizer.weight_format()`; `lmstack quantize` runs its calibration (if any) and writes each
linear weight through `encode`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import torch

DENSE = "dense"  # an unquantized checkpoint (safetensors in a float dtype)
GGUF = "gguf"
CT_PACK_QUANTIZED = "compressed-tensors/pack-quantized"  # int4 / int8 packed in int32, group scales
CT_FLOAT_QUANTIZED = "compressed-tensors/float-quantized"  # fp8 e4m3 weights + scales
CT_NVFP4 = "compressed-tensors/nvfp4-pack-quantized"  # e2m1 pairs in uint8, e4m3 scales per 16
AUTOAWQ_GEMM = "autoawq/gemm"  # AutoAWQ's qweight / qzeros / scales


def checkpoint_format_id(quantization: dict[str, Any] | None) -> str:
    """The format id of a checkpoint from its `ModelConfig.quantization` (a Hugging Face
    `quantization_config` as stored, or the GGUF summary); "<method>/<format>" for one no
    plugin in this repository knows, so an error can name it."""
    if not quantization:
        return DENSE
    if quantization.get("format") == "gguf" and "quant_method" not in quantization:
        return GGUF
    method = str(quantization.get("quant_method", "unknown")).lower()
    if method == "compressed-tensors":
        fmt = str(quantization.get("format", "")).lower()
        if fmt in ("", "mixed-precision"):
            # One config group's format stands for the checkpoint (we write one group).
            groups = quantization.get("config_groups") or {}
            formats = {str(g.get("format", "")).lower() for g in groups.values() if isinstance(g, dict)}
            formats.discard("")
            fmt = formats.pop() if len(formats) == 1 else fmt or "unknown"
        return f"compressed-tensors/{fmt}"
    if method == "awq":
        return f"autoawq/{str(quantization.get('version', 'gemm')).lower()}"
    return f"{method}/{quantization.get('format', 'unknown')}"


class WeightFormat(ABC):
    """How a dense linear weight becomes checkpoint tensors of one quantized format.

    `lmstack quantize` calls `fake_quantize` while it searches (AWQ's scales and clipping), then
    `encode` once per linear; the tensors go under the linear's checkpoint prefix
    (`model.layers.0.self_attn.q_proj.` + suffix), and `quantization_config` becomes the
    `quantization_config` of the folder's config.json."""

    method: str  # e.g. "rtn-int4", "fp8", "nvfp4"

    @abstractmethod
    def encode(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """`weight` [out, in] (fp32) of linear `name` -> checkpoint tensors by suffix, e.g.
        {"weight_packed": ..., "weight_scale": ..., "weight_zero_point": ..., "weight_shape": ...}."""

    @abstractmethod
    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """What serving would compute with: `weight` quantized and dequantized, same shape, fp32."""

    @abstractmethod
    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        """config.json's `quantization_config` for a checkpoint of this format; `ignore` lists
        the modules left dense (e.g. "lm_head")."""


@runtime_checkable
class Calibrated(Protocol):
    """A `WeightFormat` whose method searches on calibration data before `encode` (AWQ).

    `lmstack quantize` calls `calibrate(model, samples)` once, before any `encode`: `model` is a
    `lmstack_calibrate.model.DenseModel` (the dense fp32 weights by Hugging Face name, the
    decoder layers' forward pieces and, per layer, the `ScaleGroup`s of linears that share an
    input), `samples` the calibration token ids [num_samples, seq_len]. It may rewrite any
    weight in `model.weights` as long as the model's function is kept up to quantization error
    (AWQ folds per-channel scales into the previous op and clips weights); the writer then
    encodes the rewritten linears. `calibration_record()` goes into the folder's
    `lmstack_quantize.json` (the search's settings and results).

    A format that wants samples its search does not see (to pick a setting on, as the AWQ scale
    tuning picks its epoch) has a `validation_samples` attribute > 0: `lmstack quantize` then cuts
    that many more samples after --num-samples and passes them as `calibrate(...,
    validation=...)`."""

    def calibrate(self, model: Any, samples: torch.Tensor, progress: Any = None) -> None: ...

    def calibration_record(self) -> dict[str, Any]: ...
