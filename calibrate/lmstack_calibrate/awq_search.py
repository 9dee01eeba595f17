"""The AWQ search (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), over the
layers of a `lmstack_calibrate.model.DenseModel`, for any `WeightFormat` (its `fake_quantize` is
what the search optimises against). It is public so that every quantizer plugin can make its
format `Calibrated` with it (`AWQCalibration`): lmstack-awq's int4 (plus GPTQ
rounding, which that format offers through a `gptq` method) and lmstack-nvfp4's FP4.

Per decoder layer, in order:
1. run the layer on its calibration inputs and capture the input of every linear;
2. per group of linears sharing an input (`ScaleGroup`: q/k/v after the input norm, o_proj
   after attention, gate/up after the post-attention norm, down after the SwiGLU product), take
   the mean |x| of each input channel, and for alpha on a grid in [0, 1] try
   s = mean|x| ** alpha (and AutoAWQ's duo scaling, mean|x| ** alpha / mean|w~| ** (1 - alpha);
   normalised so that sqrt(max(s) * min(s)) = 1): quantize W * s with the
   format, run the group's block (attention + o_proj, the MLP, or the linear alone) with
   fake_quantize(W * s) / s and keep the alpha with the smallest output MSE against the dense
   block; fold 1/s into the op before (RMSNorm weight, or the rows of up_proj / v_proj) and s
   into the linears' input columns (an exact rewrite of the dense model; under grouped-query
   attention o_proj's scale is one per v_proj row, repeated over the query heads sharing it);
3. weight clipping (round-to-nearest only; GPTQ sets ranges as it rounds): for every linear but q/k (their error passes through the softmax, not a
   dot product: AWQ leaves them), for each (output row, input group) shrink the clip range
   [-r max|w|, r max|w|] over a grid of r and keep the r whose quantized weights give the
   smallest output error on the captured inputs; then refine each side of the range on its
   own (the grid is asymmetric, so the best range need not be centred on zero). The error of one (row, group) is
   d^T C_g d with d the weight error and C_g the inputs' covariance over that group's
   channels, so every ratio costs one small einsum instead of a matmul over all tokens;
4. with `bias_correction`, bias correction (`DenseModel.correct_biases`): o_proj's and
   down_proj's biases take the mean error of the attention block and of the MLP (dense minus
   quantized, on the calibration inputs), so that the layer's output error has no constant part;
5. propagate: the next layer's inputs are this layer's outputs with its weights quantized
   (fake_quantize of the final weights, and the biases), so later layers calibrate on what they
   will see when served.
6. with `tune_epochs` (formats that are `lmstack_calibrate.scale_tuning.ScaleTunable`), the codes are
   frozen and the group scales and biases tuned end to end towards the dense model's
   next-token distributions on the calibration samples (`tune_scales`); a few samples at the
   end of the calibration set stay out of the search and the tuning, to pick the epoch kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmstack.quant.formats import WeightFormat
from lmstack_calibrate.scale_tuning import ScaleTunable, teacher_log_probs, tune_scales


@dataclass
class AWQConfig:
    grid: int = 20  # alpha points in [0, 1] (alpha = k / grid, k = 0 .. grid - 1)
    clip_grid: int = 20  # clip ratios 1, 1 - 0.5/clip_grid, ... down to max_shrink
    max_shrink: float = 0.5  # the smallest clip ratio tried
    loss_tokens: int = 4096  # calibration tokens (whole samples) the block losses are measured on
    clip_tokens: int = 8192  # tokens the clipping covariance is estimated from
    clip: bool = True
    duo: bool = True  # also try AutoAWQ's duo scaling (activation and weight statistics)
    asymmetric_clip: bool = True  # refine each side of the clip range on its own
    # After the scales, round with GPTQ where the format offers it (`gptq`): AWQ's scaling
    # followed by GPTQ's error-compensating rounding, as llm-compressor's AWQ + GPTQ recipes do.
    # False (the default): clip and round to nearest, the AWQ paper. Measured on SmolLM2-135M
    # (held-out text, int4 g128): GPTQ fits its calibration inputs 4-8x better per layer but
    # generalises only ~2x, and the served model scored worse (+26-27 % vs +19.5 %).
    gptq: bool = False
    # After each layer is quantized, give o_proj and down_proj the biases that cancel the mean
    # output error of the attention block and the MLP on the calibration inputs (the model's
    # config then has attention_bias / mlp_bias; the other linears get zero biases). Off by
    # default here; lmstack-awq turns it on (measured on SmolLM2-135M: README).
    bias_correction: bool = False
    # After the search, tune every linear's group scales (codes frozen) and the biases end to
    # end, distilling the dense model over the calibration samples, for `tune_epochs` epochs
    # (`lmstack_calibrate.scale_tuning`; formats that are `ScaleTunable` only). `lmstack quantize` cuts
    # `tune_val_samples` more samples after the search's (`validation`), which pick the epoch
    # kept. 0 (the default here): no tuning; lmstack-awq turns it on (README).
    tune_epochs: int = 0
    tune_lr: float = 1e-3  # Adam's step on the log of each scale
    tune_bias_lr: float = 1e-3
    tune_val_samples: int = 8
    # Record per layer and group the chosen alpha (and mean clip ratio): `calibration_record`.
    history: list[dict[str, Any]] = field(default_factory=list)
    tuning: dict[str, Any] | None = None  # the scale tuning's record, when it ran


def _group_size(fmt: WeightFormat, in_features: int) -> int:
    """The format's group along the input (`group_size` attribute); a whole row when it has
    none (per-channel scales)."""
    g = getattr(fmt, "group_size", None)
    if g is None and (scheme := getattr(fmt, "scheme", None)) is not None:
        g = scheme.effective_group(in_features)  # e.g. lmstack-awq's int4 formats
    return int(g) if g else in_features


def weight_stat(weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """Mean over output rows of |w| relative to its (row, group)'s max, per input channel [in]:
    how large a channel's weights are where the quantization grid is set."""
    rows = torch.cat(weights, 0).float()
    out_f, in_f = rows.shape
    pad = (-in_f) % group
    w = torch.nn.functional.pad(rows.abs(), (0, pad)).view(out_f, -1, group)
    w = (w / (w.amax(-1, keepdim=True) + 1e-6)).view(out_f, -1)[:, :in_f]
    return w.mean(0)


@torch.no_grad()
def search_scales(
    group: Any, weights: dict[str, torch.Tensor], x: torch.Tensor, fmt: WeightFormat, cfg: AWQConfig
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The best scale s over `group.prev`'s channels (`group.expand(s)` over the input) and
    the candidate it came from; x [B, L, in] (the samples the loss is measured on). Candidates: the paper's
    s = mean|x| ** alpha and, with `cfg.duo`, s = mean|x| ** alpha / mean|w~| ** (1 - alpha)
    (w~: |w| relative to its group's max, as AutoAWQ's duo scaling), each normalised so
    that sqrt(max(s) * min(s)) = 1; alpha = 0 (s = 1, plain round-to-nearest) is always one."""
    stat = group.reduce(x.abs().reshape(-1, x.shape[-1]).float().mean(0)).clamp(min=1e-5)
    wstat = None
    if cfg.duo:
        w = [weights[name] for name in group.linears]
        wstat = group.reduce(weight_stat(w, _group_size(fmt, w[0].shape[1]))).clamp(min=1e-5)
    target = group.inspect(x, {})
    best: tuple[float, torch.Tensor, dict[str, Any]] = (float("inf"), torch.ones_like(stat), {"alpha": 0.0})
    candidates = [(k / cfg.grid, False) for k in range(cfg.grid)]
    if wstat is not None:
        candidates += [(k / cfg.grid, True) for k in range(1, cfg.grid)]
    for alpha, duo in candidates:
        s = stat.pow(alpha)
        if duo:
            s = s / wstat.pow(1 - alpha)
        s = s / (s.max() * s.min()).sqrt()
        full = group.expand(s)
        trial = {name: fmt.fake_quantize(weights[name] * full) / full for name in group.linears}
        loss = (group.inspect(x, trial) - target).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, {"alpha": alpha, "duo": True} if duo else {"alpha": alpha})
    return best[1], best[2]


def _clip_error(
    weight: torch.Tensor,
    wp: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    fmt: WeightFormat,
    cov: torch.Tensor,
) -> torch.Tensor:
    """Output error d^T C_g d per (row, group) [O, G] of `weight` clipped to [lo, hi] per
    (row, group) and quantized."""
    out_f, in_f = weight.shape
    groups, g = cov.shape[0], cov.shape[1]
    clipped = torch.maximum(torch.minimum(wp, hi), lo).reshape(out_f, -1)[:, :in_f]
    pad = groups * g - in_f
    d = torch.nn.functional.pad(weight - fmt.fake_quantize(clipped), (0, pad)).view(out_f, groups, g)
    return torch.einsum("ogk,gkl,ogl->og", d, cov, d)


@torch.no_grad()
def search_clip(
    weight: torch.Tensor, x: torch.Tensor, fmt: WeightFormat, cfg: AWQConfig
) -> tuple[torch.Tensor, float]:
    """`weight` [out, in] with each (row, group)'s range clipped to the ratio that minimises the
    output error on inputs x [N, in]; also the mean chosen ratio. First one ratio r for both
    sides ([-r max|w|, r max|w|], as the paper); with `cfg.asymmetric_clip`, then each side's
    own ratio of its extreme (max w and min w), one side at a time from that start: an
    asymmetric grid's range need not be centred on zero."""
    out_f, in_f = weight.shape
    g = _group_size(fmt, in_f)
    pad = (-in_f) % g
    groups = (in_f + pad) // g
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, groups, g)
    cov = torch.einsum("ngk,ngl->gkl", xp, xp) / xp.shape[0]  # [G, g, g]
    wp = torch.nn.functional.pad(weight, (0, pad)).view(out_f, groups, g)
    amax = wp.abs().amax(-1, keepdim=True)  # [O, G, 1]
    best_err = torch.full((out_f, groups, 1), float("inf"))
    best_ratio = torch.ones(out_f, groups, 1)
    ratios = [1.0 - (1.0 - cfg.max_shrink) * k / cfg.clip_grid for k in range(cfg.clip_grid)]
    for ratio in ratios:
        err = _clip_error(weight, wp, -amax * ratio, amax * ratio, fmt, cov).unsqueeze(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    lo, hi = -amax * best_ratio, amax * best_ratio
    if cfg.asymmetric_clip:
        wmax = wp.amax(-1, keepdim=True).clamp(min=0)
        wmin = wp.amin(-1, keepdim=True).clamp(max=0)
        for side in ("hi", "lo"):
            extreme = wmax if side == "hi" else wmin
            for ratio in ratios:
                edge = extreme * ratio
                trial_lo, trial_hi = (lo, edge) if side == "hi" else (edge, hi)
                err = _clip_error(weight, wp, trial_lo, trial_hi, fmt, cov).unsqueeze(-1)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                if side == "hi":
                    hi = torch.where(better, edge, hi)
                else:
                    lo = torch.where(better, edge, lo)
    clipped = torch.maximum(torch.minimum(wp, hi), lo).reshape(out_f, -1)[:, :in_f]
    kept = (hi - lo) / (
        wp.amax(-1, keepdim=True).clamp(min=0) - wp.amin(-1, keepdim=True).clamp(max=0) + 1e-12
    )
    return clipped.contiguous(), float(kept.clamp(max=1).mean())


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
    model: Any,
    samples: torch.Tensor,
    fmt: WeightFormat,
    cfg: AWQConfig,
    progress: Any = None,
    on_epoch: Callable[[int, dict[str, float], dict[str, torch.Tensor]], None] | None = None,
    validation: torch.Tensor | None = None,
) -> None:
    """Run AWQ over every layer of `model` (a `DenseModel`), rewriting its weights in place;
    then, with `cfg.tune_epochs`, tune the scales end to end (`on_epoch`: called after each
    epoch; `validation`: samples [n, seq_len] that pick the epoch kept, none: the last)."""
    weights = model.weights
    # GPTQ rounds against the scaled weights themselves: a clipped copy would make the clipping
    # error part of its target (the clipped-off outliers could never come back), and GPTQ sets
    # each group's range as it walks, so the clipping search is for round-to-nearest only.
    gptq = cfg.gptq and hasattr(fmt, "gptq")
    tuning = cfg.tune_epochs > 0 and isinstance(fmt, ScaleTunable)
    if tuning:  # the dense model's distributions, before any weight changes
        val = validation if validation is not None else samples[:0]
        teacher = teacher_log_probs(model, torch.cat([samples, val]))
    x = model.embed(samples)
    loss_n = max(1, min(samples.shape[0], cfg.loss_tokens // samples.shape[1]))
    bar = progress(model.num_layers, "awq", "layers") if progress is not None else None
    for i in range(model.num_layers):
        started = time.perf_counter()
        _, inputs = model.layer_forward(i, x, capture=True)
        record: dict[str, Any] = {"layer": i}
        groups = model.scale_groups(i)
        # The layer's linears before clipping or GPTQ, scaled as the search folds: the exact
        # dense layer, the reference of the bias correction.
        unclipped: dict[str, torch.Tensor] = {}
        for group in groups:
            xin = inputs[group.input]
            if group.prev is not None:
                s_prev, chosen = search_scales(group, weights, xin[:loss_n], fmt, cfg)
                _fold(weights, group.prev, s_prev)
                if group.prev in unclipped:
                    _fold(unclipped, group.prev, s_prev)
                s = group.expand(s_prev)
                for name in group.linears:
                    weights[name] = weights[name] * s
                inputs[group.input] = xin = xin / s
                record[group.input] = chosen
            if cfg.clip and not gptq:
                flat = xin.reshape(-1, xin.shape[-1])
                step = max(1, flat.shape[0] // cfg.clip_tokens)
                flat = flat[::step]
                for name in group.clip:
                    unclipped[name] = weights[name]
                    weights[name], ratio = search_clip(weights[name], flat, fmt, cfg)
                    record.setdefault(group.input, {})[name.rsplit(".", 2)[-2] + "_clip"] = round(ratio, 4)
        rounded: set[str] = set()
        if gptq:
            # Every scale of the layer is folded by now (o_proj's lands in v_proj's rows), so
            # each linear is rounded once, against its (scaled) captured inputs.
            for group in groups:
                flat = inputs[group.input].reshape(-1, inputs[group.input].shape[-1]).float()
                h = flat.t() @ flat / flat.shape[0]
                for name in group.linears:
                    unclipped[name] = weights[name]
                    weights[name] = fmt.gptq(name.removesuffix(".weight"), weights[name], h)
                    rounded.add(name)
        quantized = {
            name: weights[name] if name in rounded else fmt.fake_quantize(weights[name])
            for name in model.linear_names(i)
        }
        if cfg.bias_correction:
            dense = {name: unclipped.get(name, weights[name]) for name in model.linear_names(i)}
            model.correct_biases(i, x, dense, quantized)
        x, _ = model.layer_forward(i, x, quantized)
        record["seconds"] = round(time.perf_counter() - started, 2)
        cfg.history.append(record)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if tuning:
        with torch.enable_grad():
            result = tune_scales(
                model,
                fmt,  # type: ignore[arg-type]
                samples,
                val,
                teacher,
                epochs=cfg.tune_epochs,
                lr=cfg.tune_lr,
                bias_lr=cfg.tune_bias_lr,
                progress=progress,
                on_epoch=on_epoch,
            )
        cfg.tuning = {
            "epochs": cfg.tune_epochs,
            "lr": cfg.tune_lr,
            "bias_lr": cfg.tune_bias_lr,
            "train_samples": int(samples.shape[0]),
            "val_samples": int(val.shape[0]),
            "best_epoch": result.best_epoch,
            "history": result.epochs,
            "seconds": result.seconds,
        }


class AWQCalibration:
    """A mixin for a `WeightFormat` that makes it `lmstack.quant.formats.Calibrated` with AWQ:
    `calibrate` runs `awq_calibrate` with `self.awq` (an `AWQConfig`)."""

    awq: AWQConfig

    def calibrate(
        self, model: Any, samples: torch.Tensor, progress: Any = None, validation: torch.Tensor | None = None
    ) -> None:
        if not hasattr(self, "awq"):
            self.awq = AWQConfig()
        awq_calibrate(model, samples, self, self.awq, progress, validation=validation)  # type: ignore[arg-type]

    @property
    def validation_samples(self) -> int:
        """Samples `lmstack quantize` cuts beyond --num-samples and passes as `calibrate`'s
        `validation`: the scale tuning's (0 without it)."""
        cfg = getattr(self, "awq", AWQConfig())
        return cfg.tune_val_samples if cfg.tune_epochs > 0 and isinstance(self, ScaleTunable) else 0

    def calibration_record(self) -> dict[str, Any]:
        cfg = getattr(self, "awq", AWQConfig())
        return {
            "algorithm": "awq",
            "grid": cfg.grid,
            "clip": cfg.clip and not (cfg.gptq and hasattr(self, "gptq")),
            "clip_grid": cfg.clip_grid,
            "duo": cfg.duo,
            "asymmetric_clip": cfg.asymmetric_clip,
            "rounding": "gptq" if cfg.gptq and hasattr(self, "gptq") else "nearest",
            "bias_correction": cfg.bias_correction,
            "max_shrink": cfg.max_shrink,
            "loss_tokens": cfg.loss_tokens,
            "propagation": "quantized",
            "layers": cfg.history,
            "scale_tuning": cfg.tuning,
        }
