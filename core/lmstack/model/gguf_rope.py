"""RoPE scaling from a GGUF file: `<arch>.rope.scaling.*` keys as Hugging Face's `rope_scaling`,
and llama.cpp's `rope_freqs` tensor (Llama 3.1's frequency divisors) fitted back to the llama3
parameters our RoPE takes. Phi-3's LongRoPE factor tensors are read by its family
(`lmstack.model.gguf_loader`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lmstack.errors import ConfigError
from lmstack.model.checkpoint import GGUFTensor

# GGUF rope.scaling.* suffix -> Hugging Face rope_scaling key, with its type.
_ROPE_KEYS: dict[str, tuple[str, type]] = {
    "factor": ("factor", float),
    "original_context_length": ("original_max_position_embeddings", int),
    "attn_factor": ("attention_factor", float),
    "yarn_beta_fast": ("beta_fast", float),
    "yarn_beta_slow": ("beta_slow", float),
}
# The rope.scaling.type values llama.cpp writes, as Hugging Face names them.
_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}


def gguf_rope_scaling(
    meta: Mapping[str, Any], arch: str, rope_freqs: GGUFTensor | None, theta: float, rope_dim: int
) -> dict[str, Any] | None:
    """Hugging Face style rope_scaling from `{arch}.rope.scaling.*`, or from a `rope_freqs` tensor
    (llama.cpp's encoding of Llama 3.1 scaling). Phi-3's LongRoPE is read by its family."""
    if rope_freqs is not None:
        divisors = rope_freqs.dequantize(torch.float32).double()
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        return fit_llama3_rope_scaling(divisors, theta, rope_dim, original)
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None and (linear := meta.get(f"{arch}.rope.scale_linear")) is not None:
        kind, meta = "linear", {**meta, f"{arch}.rope.scaling.factor": linear}  # older files
    if kind in (None, "none") or (arch == "phi3" and kind in ("longrope", "su")):
        return None
    if kind not in _ROPE_TYPES:
        raise ConfigError(
            f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
        )
    scaling: dict[str, Any] = {"rope_type": _ROPE_TYPES[kind]}
    for suffix, (hf_key, cast) in _ROPE_KEYS.items():
        if (value := meta.get(f"{arch}.rope.scaling.{suffix}")) is not None:
            scaling[hf_key] = cast(value)
    return scaling


def llama3_rope_divisors(
    theta: float, rope_dim: int, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """Per-frequency divisors [rope_dim // 2] that llama3 scaling applies to the default inverse
    frequencies: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    return 1.0 / ((1 - smooth) / factor + smooth)


def fit_llama3_rope_scaling(
    divisors: torch.Tensor, theta: float, rope_dim: int, original: int | None = None
) -> dict[str, Any] | None:
    """The llama3 rope_scaling parameters that reproduce llama.cpp's `rope_freqs` divisors.

    The file keeps only the divisors, not the parameters our RoPE takes. `factor` is the largest
    divisor; the low/high frequency factors and the original context are searched over the values
    Llama 3.x releases use, and a fit must reproduce every divisor to 1e-4.
    """
    factor = float(divisors.max())
    if math.isclose(factor, 1.0) and math.isclose(float(divisors.min()), 1.0):
        return None
    originals = [original] if original else [8192, 4096, 2048, 16384, 32768, 65536, 131072]
    for ctx in originals:
        for low in (1.0, 2.0, 4.0):
            for high in (4.0, 8.0, 2.0, 16.0, 32.0):
                if high <= low:
                    continue
                expected = llama3_rope_divisors(theta, rope_dim, factor, low, high, int(ctx))
                if torch.allclose(expected, divisors, rtol=1e-4, atol=0):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": int(ctx),
                    }
    raise ConfigError(
        "GGUF rope_freqs tensor does not match any llama3 RoPE scaling; this file is unsupported"
    )
