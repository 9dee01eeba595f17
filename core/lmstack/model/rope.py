"""Rotary position embeddings, including the scaling variants found in Llama configs."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention factor that scales cos / sin.

    Supported `rope_type`s: default, linear, dynamic (NTK, evaluated at the configured maximum
    length: our cache stores rotated keys, so the frequencies must not change mid-sequence),
    llama3, yarn.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind == "dynamic":
        # NTK-aware base change: theta' = theta * (factor)^(d / (d - 2)).
        base = theta * factor ** (head_dim / (head_dim - 2))
        return (1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))).float(), 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float(), 1.0
    if kind == "yarn":
        old_len = float(scaling.get("original_max_position_embeddings", 4096))
        beta_fast = float(scaling.get("beta_fast", 32.0))
        beta_slow = float(scaling.get("beta_slow", 1.0))
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def dim_for(rotations: float) -> float:
            return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo = max(math.floor(dim_for(beta_fast)), 0)
        hi = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
        freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return freq.float(), float(mscale)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, dynamic, llama3, yarn)")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos / sin tables, indexed by position; HF's rotate-half convention."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq, attn_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attn_factor, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions: [T, 1, D/2] in `dtype` (once per step, shared by all layers)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def tables_full(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rotate_` takes: cos twice and (-sin, sin) side by side, [T, 1, 2, D/2] in `dtype`
        (once per step: the sign and duplication cost nothing per layer)."""
        cos, sin = self.tables(positions, dtype)
        return torch.stack((cos, cos), dim=2), torch.stack((-sin, sin), dim=2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos / sin [T, 1, D/2] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` in place on x [T, H, D] (any strides with a contiguous last dim), from
    `RotaryEmbedding.tables_full` cos / sin [T, 1, 2, D/2]: x * cos + swap_halves(x) * (-sin, sin).
    Four kernels and no concatenation. Bit-identical to `rotate`: a + b * (-s) rounds exactly as
    a - b * s, and every product is the same product."""
    halves = x.unflatten(-1, (2, -1))  # [T, H, 2, D/2], a view
    swapped = halves.flip(-2).mul_(sin)  # (x2, x1) * (-sin, sin), a fresh tensor
    halves.mul_(cos).add_(swapped)
    return x
