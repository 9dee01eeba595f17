"""Scaled FP8 KV cache: how values are stored, read back, and how the scales are chosen.

A float8 cache holds `value / scale` per layer and KV head (scales are fp32 tensors of shape
[num_kv_heads]); reading multiplies back. The scales are fixed once, at load, by a calibration
forward (`calibrate_kv_scales`), and never change while serving: every block written under one
scale stays readable without requantizing, blocks swapped to a lower tier or disk come back
under the same scale, and the calibration input is a fixed token sequence, so a restarted
server on the same model and dtype derives the same scales (the tiered cache's disk blocks stay
valid).

Why a generous headroom is cheap: float8 is floating point, so its relative rounding error is
the same at every magnitude down to the subnormals (e4m3: 2^-6 x scale). The scale only has to
keep values under the format's max (448 for e4m3); `HEADROOM` x the calibrated absolute max
leaves room for activations that exceed the calibration's while moving only values below
~2^-6 / HEADROOM of it into the subnormal range. Writes clamp to the format's max, so a value
past even that saturates instead of becoming NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmstack.model.config import ModelConfig

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Calibrated absolute max x HEADROOM maps to the format's max.
HEADROOM = 4.0
# Calibration input: this many token ids, drawn from the vocabulary by a fixed seed, in one
# sequence: no tokenizer or text needed at load, and the same scales on every start. Random
# ids are not text, so HEADROOM covers the gap (measured end to end: SmolLM2 perplexity +0.70 %
# with these scales, benchmarks/HISTORY.md, quant_cpu-2026-12-01).
CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a KV cache in `dtype` stores scaled values (and so needs k_scale / v_scale)."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> `dtype` holding x / scale (scale [Hkv]), clamped to the format's range."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale.view(-1, 1)).clamp_(-limit, limit).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values a scaled cache holds, in `dtype`: stored [..., Hkv, D] x scale [Hkv]."""
    return (stored.float() * scale.view(-1, 1)).to(dtype)


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head scales that map HEADROOM x `amax` to the format's max (1.0 for a head that was
    all zeros)."""
    scale = amax.float() * HEADROOM / torch.finfo(dtype).max
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class _AmaxRecorder:
    """An attention callable (`lmstack.model.architecture.AttentionFn`) for one unpaged causal
    sequence: records each layer's per-head absolute max of K and V, attends densely as the
    model's kernels do (`config`: each layer's window, the attention scale and score
    soft-capping, so that later layers see the K/V they will serve; Gemma)."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.config = config

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from lmstack.components.torch_attention import causal_mask, grouped_attention

        self.amax[layer] = (k.abs().amax(dim=(0, 2)).float(), v.abs().amax(dim=(0, 2)).float())
        (t, hq, d), hkv, c = q.shape, k.shape[1], self.config
        g = hq // hkv
        window = c.layer_window(layer) if c is not None else None
        scale = c.attn_scale if c is not None and c.attn_scale is not None else d**-0.5
        softcap = c.attn_logit_softcap if c is not None else None
        qt = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)  # rows (g, t)
        pos = torch.arange(t, device=q.device)
        mask = causal_mask(pos, pos, window).repeat(g, 1).unsqueeze(0)  # [1, g*t, t]
        o = grouped_attention(qt, k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap)
        return o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)


@torch.inference_mode()
def calibrate_kv_scales(
    model: torch.nn.Module, vocab_size: int, num_layers: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) per layer, each [Hkv] fp32 on `device`, from one forward over the
    fixed calibration tokens."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=gen).to(device)
    positions = torch.arange(CALIBRATION_TOKENS, device=device)
    recorder = _AmaxRecorder(getattr(model, "config", None))
    model(ids, positions, recorder, ids.new_zeros(1))
    if len(recorder.amax) != num_layers:
        raise RuntimeError(f"KV calibration saw {len(recorder.amax)} attention layers, expected {num_layers}")
    return [
        (scales_from_amax(k, dtype), scales_from_amax(v, dtype))
        for k, v in (recorder.amax[i] for i in range(num_layers))
    ]
