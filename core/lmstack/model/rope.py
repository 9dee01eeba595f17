"""Rotary position embeddings, including the scaling variants found in Hugging Face configs.

Our KV cache stores rotated keys, so a position's rotation is fixed once it is cached: every
variant here gives one table per position, never one that changes with the sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lmstack.errors import ConfigError

# rope_type -> the keys a scaling dict of that type may carry (besides rope_type / type and the
# RoPE base and partial-rotary fraction that transformers 5 keeps in the same dict). Any other
# key is refused by `check_rope_scaling`: a parameter we would ignore changes the model.
ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {"factor", "short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"}
    ),
}
_ALWAYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# What each type cannot do without (the config parsers fill `original_max_position_embeddings`
# and a longrope `factor` from the config's top level, as transformers does).
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
}


def check_rope_scaling(scaling: Mapping[str, Any] | None, rotary_dim: int, where: str) -> None:
    """ConfigError (one line, naming `where`) for a scaling dict this module would not compute
    exactly: an unknown rope_type, a key that type does not take, a missing required key, or
    longrope factor lists of the wrong length."""
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: RoPE scaling type {kind!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})"
        )
    extra = sorted(set(scaling) - ROPE_TYPES[kind] - _ALWAYS)
    if extra:
        raise ConfigError(f"{where}: RoPE scaling {kind!r} has {extra[0]!r}, which is not implemented")
    missing = [k for k in _REQUIRED.get(kind, ()) if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: RoPE scaling {kind!r} lacks {missing[0]!r}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ConfigError(
                    f"{where}: longrope {key} has {len(scaling[key])} entries; the {rotary_dim} rotated "
                    f"dimensions need {rotary_dim // 2}"
                )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention factor that scales cos / sin.
    `head_dim` is the rotated width (a partial rotary model's rotated part).

    Supported `rope_type`s (`ROPE_TYPES`): default, linear, dynamic (NTK), llama3, yarn,
    longrope. Dynamic NTK and LongRoPE change with the sequence length in transformers; here
    the table is fixed by the longest context the model serves, `max_positions` (the module
    docstring says why). LongRoPE (Phi-3) has two factor lists: transformers rotates a sequence
    with the short ones while it fits the original context and re-rotates all of it with the
    long ones once it is longer. Here: the short factors when `max_positions` fits the original
    context (every sequence then gets transformers' rotation), else the long ones (transformers'
    rotation of every sequence longer than the original context).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor") or 1.0)
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind == "dynamic":
        # NTK-aware base change, which transformers makes only for a sequence longer than the
        # original context L0, at its length L: theta * (factor * L / L0 - factor + 1)^(d / (d - 2)).
        # Fixed at the longest context served (see above): no change where that fits L0.
        old_len = scaling.get("original_max_position_embeddings") or max_positions
        if max_positions is None or old_len is None or max_positions <= int(old_len):
            return inv_freq.float(), 1.0
        grow = factor * max_positions / int(old_len) - factor + 1
        base = theta * grow ** (head_dim / (head_dim - 2))
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
        beta_fast = float(scaling.get("beta_fast") or 32.0)
        beta_slow = float(scaling.get("beta_slow") or 1.0)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None and mscale and mscale_all_dim:  # DeepSeek-style: a ratio
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                factor, float(mscale_all_dim)
            )
        elif attention_factor is None:
            attention_factor = _yarn_mscale(factor)

        def dim_for(rotations: float) -> float:
            return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = dim_for(beta_fast), dim_for(beta_slow)
        if scaling.get("truncate", True):  # gpt-oss turns the rounding to whole dimensions off
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
        freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return freq.float(), float(attention_factor)
    if kind == "longrope":
        old_len = int(scaling["original_max_position_embeddings"])
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:  # the LongRoPE paper's, from the context extension ratio
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(old_len)) if factor > 1 else 1.0
        long = max_positions is not None and max_positions > old_len
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        return (inv_freq / ext).float(), float(attention_factor)
    raise ConfigError(f"RoPE scaling type {kind!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos / sin tables, indexed by position; HF's rotate-half convention. `head_dim`
    is the rotated width: a partial rotary model (Phi-4-mini) builds it with its rotated part."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq, attn_factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
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
