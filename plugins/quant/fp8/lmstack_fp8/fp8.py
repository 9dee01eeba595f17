"""FP8 e4m3 arithmetic: quantizing weights (per tensor or per output channel) and activations
(per token, or with a static scale), as compressed-tensors' float-quantized format defines it:
value = fp8 * scale, scale = absmax / 448."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-12  # keeps an all-zero row's scale finite


def weight_scale(weight: torch.Tensor, per_channel: bool = True) -> torch.Tensor:
    """fp32 scales of `weight` [out, in]: [out, 1] per output channel, or [1] per tensor."""
    w = weight.float().abs()
    amax = w.amax(dim=1, keepdim=True) if per_channel else w.amax().reshape(1)
    return (amax / FP8_MAX).clamp(min=_TINY)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale`, saturated to the e4m3 range and rounded to e4m3 (computed in fp32)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale) of a dense [out, in] weight."""
    scale = weight_scale(weight, per_channel)
    return to_fp8(weight, scale), scale


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scales [..., 1] (fp32): absmax times fp32(1 / 448). A
    multiplication, not a division, so that every device agrees to the bit: torch on CUDA divides
    by a Python number through its reciprocal, on the CPU it divides (the two differ in the last
    bit for about half of all values), and quantize_kernel.py multiplies as here."""
    return (x.float().abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=_TINY)


def fake_quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
    """What an FP8 matmul sees of `x`: rounded to e4m3 under its per-token (or static) scale,
    back in x's dtype."""
    scale = token_scales(x) if static_scale is None else static_scale.float()
    return (to_fp8(x, scale).float() * scale).to(x.dtype)
