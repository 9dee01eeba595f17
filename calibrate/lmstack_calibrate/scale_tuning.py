"""End-to-end tuning of a quantized model's group scales, after a calibrating search (AWQ).

A layer-by-layer search (scales, clipping, rounding, bias correction) chooses each layer blind
to what the later layers and the head make of its error. Here, with the codes and zero points
the search left frozen, the per-group scales (as s0 * exp(theta), so a step moves every scale
by the same fraction, however small the weights) and the linears' biases are moved by Adam on
the KL divergence from the dense model's next-token distribution over the calibration samples:
the quantized model is distilled towards the dense one through the few parameters the
checkpoint already stores (one scale per row and group, 1/128 of the weights at group 128).
The epoch kept is the one with the least KL on validation samples cut from the calibration
text after the search's (`lmstack quantize` cuts them: `lmstack_calibrate.calibration_text.split_validation`;
none: the last epoch).

A format takes part by implementing `ScaleTunable` (lmstack-awq's int4 does); the teacher's
log-probabilities are held in fp16, [samples, seq_len, vocab] (SmolLM2-135M, 40 x 512 tokens:
2 GB).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class ScaleTunable(Protocol):
    """A weight format whose quantized linears are codes times per-group scales."""

    def tune_start(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Quantize linear `name` (the module name, no `.weight`) as the format would encode it
        and return (codes [out, in] fp32 with the zero point subtracted, scales [out, groups]
        fp32, group size): the linear is codes * scales repeated over each group's columns."""
        ...

    def tune_finish(self, name: str, scales: torch.Tensor) -> torch.Tensor:
        """Keep `scales` (rounded to the stored dtype) for linear `name`'s `encode`; return the
        weight as served (fp32)."""
        ...


@dataclass
class TuneResult:
    epochs: list[dict[str, float]]  # per epoch: train_kl, val_kl (and epoch 0: val_kl before)
    best_epoch: int
    seconds: float


@torch.no_grad()
def teacher_log_probs(model: Any, samples: torch.Tensor) -> list[torch.Tensor]:
    """The dense model's next-token log-probabilities per sample, [seq_len, vocab] fp16."""
    return [F.log_softmax(model.logits(s[None])[0], -1).half() for s in samples]


def _kl(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || model)."""
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), -1)
    t = teacher.float().reshape(-1, teacher.shape[-1])
    return (t.exp() * (t - logp)).sum(-1).mean()


def tune_scales(
    model: Any,
    fmt: ScaleTunable,
    train: torch.Tensor,
    val: torch.Tensor,
    teacher: list[torch.Tensor],
    *,
    epochs: int,
    lr: float,
    bias_lr: float,
    seed: int = 0,
    progress: Any = None,
    on_epoch: Callable[[int, dict[str, float], dict[str, torch.Tensor]], None] | None = None,
) -> TuneResult:
    """Tune the scales of every decoder linear of `model` (a `lmstack_calibrate.model.DenseModel`
    whose linears hold what the search left: to be quantized by `fmt.tune_start`) and its
    linears' biases, `epochs` passes over `train` one sample a step; `teacher` holds the dense
    model's log-probs of train's then val's samples. Leaves the served weights in
    `model.weights` and the tuned scales in `fmt` (for `encode`). `on_epoch(epoch, record,
    linears)`, after each epoch (and before the first): its record and every linear as it
    stands (fp32, unrounded scales; the biases are `model.weights`' own)."""
    started = time.perf_counter()
    names = model.all_linear_names()
    codes: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    group: dict[str, int] = {}
    for n in names:
        codes[n], base[n], group[n] = fmt.tune_start(n.removesuffix(".weight"), model.weights[n])
    theta = {n: torch.zeros_like(base[n], requires_grad=True) for n in names}
    bias_keys = [k for k in model.weights if k.endswith(".bias")]
    for k in bias_keys:
        model.weights[k] = model.weights[k].detach().clone().requires_grad_(True)

    def linears(layer: int) -> dict[str, torch.Tensor]:
        out = {}
        for n in model.linear_names(layer):
            s = (base[n] * theta[n].exp()).repeat_interleave(group[n], dim=1)[:, : codes[n].shape[1]]
            out[n] = codes[n] * s
        return out

    @torch.no_grad()
    def report(epoch: int) -> None:
        if on_epoch is not None:
            every = {n: w for i in range(model.num_layers) for n, w in linears(i).items()}
            on_epoch(epoch, history[-1], every)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        x = model.embed(ids)
        for i in range(model.num_layers):
            x, _ = model.layer_forward(i, x, linears(i))
        return model.head(x)

    @torch.no_grad()
    def val_kl() -> float:
        if val.shape[0] == 0:
            return float("nan")
        t_val = teacher[train.shape[0] :]
        return sum(_kl(logits(s[None]), t).item() for s, t in zip(val, t_val)) / val.shape[0]

    def snapshot() -> list[torch.Tensor]:
        return [theta[n].detach().clone() for n in names] + [
            model.weights[k].detach().clone() for k in bias_keys
        ]

    params = [
        {"params": [theta[n] for n in names], "lr": lr},
        {"params": [model.weights[k] for k in bias_keys], "lr": bias_lr},
    ]
    opt = torch.optim.Adam([p for p in params if p["params"]])
    gen = torch.Generator().manual_seed(seed)
    best_val, best_epoch, best = val_kl(), 0, snapshot()
    history: list[dict[str, float]] = [{"epoch": 0, "val_kl": round(best_val, 5)}]
    report(0)
    bar = progress(epochs * train.shape[0], "tune scales", "samples") if progress is not None else None
    for epoch in range(1, epochs + 1):
        total = 0.0
        for j in torch.randperm(train.shape[0], generator=gen).tolist():
            loss = _kl(logits(train[j][None]), teacher[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            if bar is not None:
                bar.update(1)
        v = val_kl()
        history.append({"epoch": epoch, "train_kl": round(total / train.shape[0], 5), "val_kl": round(v, 5)})
        report(epoch)
        if val.shape[0] == 0 or v < best_val:
            best_val, best_epoch, best = v, epoch, snapshot()
    if bar is not None:
        bar.close()
    with torch.no_grad():
        for n, t in zip(names, best[: len(names)]):
            model.weights[n] = fmt.tune_finish(n.removesuffix(".weight"), base[n] * t.exp())
        for k, b in zip(bias_keys, best[len(names) :]):
            model.weights[k] = b
    return TuneResult(history, best_epoch, round(time.perf_counter() - started, 1))
