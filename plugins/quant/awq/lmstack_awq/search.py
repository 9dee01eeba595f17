"""The AWQ search (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), over the
layers of a `lmstack.quantize.CalibrationModel`, for any `WeightFormat` (its `fake_quantize` is
what the search optimises against).

Per decoder layer, in order:
1. run the layer on its calibration inputs and capture the input of every linear;
2. per group of linears sharing an input (`ScaleGroup`: q/k/v after the input norm, o_proj
   after attention, gate/up after the post-attention norm, down after the SwiGLU product), take
   the mean |x| of each input channel, and for alpha on a grid in [0, 1] try
   s = mean|x| ** alpha (normalised so that sqrt(max(s) * min(s)) = 1): quantize W * s with the
   format, run the group's block (attention + o_proj, the MLP, or the linear alone) with
   fake_quantize(W * s) / s and keep the alpha with the smallest output MSE against the dense
   block; fold 1/s into the op before (RMSNorm weight, or the rows of up_proj / v_proj) and s
   into the linears' input columns (an exact rewrite of the dense model);
3. weight clipping: for every linear but q/k (their error passes through the softmax, not a
   dot product: AWQ leaves them), for each (output row, input group) shrink the clip range
   [-r max|w|, r max|w|] over a grid of r and keep the r whose quantized weights give the
   smallest output error on the captured inputs. The error of one (row, group) is
   d^T C_g d with d the weight error and C_g the inputs' covariance over that group's
   channels, so every ratio costs one small einsum instead of a matmul over all tokens;
4. propagate: the next layer's inputs are this layer's outputs with its weights quantized
   (fake_quantize of the final weights), so later layers calibrate on what they will see
   when served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmstack.quant_format import WeightFormat
from lmstack_awq.int4_format import Int4WeightFormat
from lmstack_awq.int4_math import Int4Scheme


@dataclass
class AWQConfig:
    grid: int = 20  # alpha points in [0, 1] (alpha = k / grid, k = 0 .. grid - 1)
    clip_grid: int = 20  # clip ratios 1, 1 - 0.5/clip_grid, ... down to max_shrink
    max_shrink: float = 0.5  # the smallest clip ratio tried
    loss_tokens: int = 4096  # calibration tokens (whole samples) the block losses are measured on
    clip_tokens: int = 8192  # tokens the clipping covariance is estimated from
    clip: bool = True
    # Record per layer and group the chosen alpha (and mean clip ratio): `calibration_record`.
    history: list[dict[str, Any]] = field(default_factory=list)


def _group_size(fmt: WeightFormat, in_features: int) -> int:
    """The format's group along the input (`group_size` attribute); a whole row when it has
    none (per-channel scales)."""
    g = getattr(fmt, "group_size", None)
    if g is None and (scheme := getattr(fmt, "scheme", None)) is not None:
        g = scheme.effective_group(in_features)  # lmstack_awq.int4_format.Int4WeightFormat
    return int(g) if g else in_features


@torch.no_grad()
def search_scales(
    group: Any, weights: dict[str, torch.Tensor], x: torch.Tensor, fmt: WeightFormat, cfg: AWQConfig
) -> tuple[torch.Tensor, float]:
    """The best per-input-channel scale s [in] for `group` and its alpha; x [B, L, in] (the
    samples the loss is measured on)."""
    stat = x.abs().reshape(-1, x.shape[-1]).float().mean(0).clamp(min=1e-5)
    target = group.inspect(x, {})
    best = (float("inf"), torch.ones_like(stat), 0.0)
    for k in range(cfg.grid):
        alpha = k / cfg.grid
        s = stat.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        trial = {name: fmt.fake_quantize(weights[name] * s) / s for name in group.linears}
        loss = (group.inspect(x, trial) - target).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def search_clip(
    weight: torch.Tensor, x: torch.Tensor, fmt: WeightFormat, cfg: AWQConfig
) -> tuple[torch.Tensor, float]:
    """`weight` [out, in] with each (row, group)'s range clipped to the ratio that minimises the
    output error on inputs x [N, in]; also the mean chosen ratio."""
    out_f, in_f = weight.shape
    g = _group_size(fmt, in_f)
    pad = (-in_f) % g
    groups = (in_f + pad) // g
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, groups, g)
    cov = torch.einsum("ngk,ngl->gkl", xp, xp) / xp.shape[0]  # [G, g, g]
    wp = torch.nn.functional.pad(weight, (0, pad)).view(out_f, groups, g)
    amax = wp.abs().amax(-1, keepdim=True)  # [O, G, 1]
    best_err = torch.full((out_f, groups), float("inf"))
    best_ratio = torch.ones(out_f, groups)
    for k in range(cfg.clip_grid):
        ratio = 1.0 - (1.0 - cfg.max_shrink) * k / cfg.clip_grid
        lim = amax * ratio
        clipped = torch.maximum(torch.minimum(wp, lim), -lim).reshape(out_f, -1)[:, :in_f]
        d = torch.nn.functional.pad(weight - fmt.fake_quantize(clipped), (0, pad)).view(out_f, groups, g)
        err = torch.einsum("ogk,gkl,ogl->og", d, cov, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    lim = amax * best_ratio.unsqueeze(-1)
    clipped = torch.maximum(torch.minimum(wp, lim), -lim).reshape(out_f, -1)[:, :in_f]
    return clipped.contiguous(), float(best_ratio.mean())


def _fold(weights: dict[str, torch.Tensor], prev: str, s: torch.Tensor) -> None:
    """Divide `prev`'s output channels by s: an RMSNorm weight [in], or a linear's rows (and
    bias) [in, *]."""
    w = weights[prev]
    weights[prev] = (w / s) if w.dim() == 1 else (w / s.view(-1, 1))
    bias = prev.removesuffix("weight") + "bias"
    if w.dim() == 2 and bias in weights:
        weights[bias] = weights[bias] / s


@torch.no_grad()
def awq_calibrate(
    model: Any, samples: torch.Tensor, fmt: WeightFormat, cfg: AWQConfig, progress: Any = None
) -> None:
    """Run AWQ over every layer of `model` (a `CalibrationModel`), rewriting its weights in place."""
    weights = model.weights
    x = model.embed(samples)
    loss_n = max(1, min(samples.shape[0], cfg.loss_tokens // samples.shape[1]))
    bar = progress(model.num_layers, "awq", "layers") if progress is not None else None
    for i in range(model.num_layers):
        started = time.perf_counter()
        _, inputs = model.layer_forward(i, x, capture=True)
        record: dict[str, Any] = {"layer": i}
        for group in model.scale_groups(i):
            xin = inputs[group.input]
            if group.prev is not None:
                s, alpha = search_scales(group, weights, xin[:loss_n], fmt, cfg)
                _fold(weights, group.prev, s)
                for name in group.linears:
                    weights[name] = weights[name] * s
                inputs[group.input] = xin = xin / s
                record[group.input] = {"alpha": alpha}
            if cfg.clip:
                flat = xin.reshape(-1, xin.shape[-1])
                step = max(1, flat.shape[0] // cfg.clip_tokens)
                flat = flat[::step]
                for name in group.clip:
                    weights[name], ratio = search_clip(weights[name], flat, fmt, cfg)
                    record.setdefault(group.input, {})[name.rsplit(".", 2)[-2] + "_clip"] = round(ratio, 4)
        quantized = {name: fmt.fake_quantize(weights[name]) for name in model.linear_names(i)}
        x, _ = model.layer_forward(i, x, quantized)
        record["seconds"] = round(time.perf_counter() - started, 2)
        cfg.history.append(record)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


class AWQCalibration:
    """A mixin for a `WeightFormat` that makes it `lmstack.quant_format.Calibrated` with AWQ:
    `calibrate` runs `awq_calibrate` with `self.awq` (an `AWQConfig`)."""

    awq: AWQConfig

    def calibrate(self, model: Any, samples: torch.Tensor, progress: Any = None) -> None:
        if not hasattr(self, "awq"):
            self.awq = AWQConfig()
        awq_calibrate(model, samples, self, self.awq, progress)  # type: ignore[arg-type]

    def calibration_record(self) -> dict[str, Any]:
        cfg = getattr(self, "awq", AWQConfig())
        return {
            "algorithm": "awq",
            "grid": cfg.grid,
            "clip": cfg.clip,
            "clip_grid": cfg.clip_grid,
            "max_shrink": cfg.max_shrink,
            "loss_tokens": cfg.loss_tokens,
            "propagation": "quantized",
            "layers": cfg.history,
        }


class AwqWeightFormat(AWQCalibration, Int4WeightFormat):
    """What `lmstack quantize --method awq` writes: compressed-tensors pack-quantized int4, after
    the AWQ search (`Calibrated`)."""

    def __init__(self, scheme: Int4Scheme | None = None, config: AWQConfig | None = None) -> None:
        super().__init__("awq", scheme)
        self.awq = config or AWQConfig()
