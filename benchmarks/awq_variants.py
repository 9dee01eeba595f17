"""Where int4 g128's perplexity goes on SmolLM2-135M, and what the AWQ search's alternatives give.

All in one process, fp32, the model held by `lmstack.quantize.CalibrationModel` (the weights
`lmstack quantize` calibrates), perplexity over `benchmarks/data/heldout_gpl3.txt` in 512-token
windows with the tied head dense (what the linears cost, not the head):

- `sensitivity`: the dense model, round-to-nearest int4 (asymmetric, min/max) of every linear at
  group 128 and at group 32, then of one kind of linear at a time (q, k, v, o, gate, up, down).
- a variant of the AWQ search (the first argument), calibrated on `--calibration` (default: the model's
  own answers, made as `lmstack quantize --calibration self` makes them and kept in
  `--self-text`):
  - `awq`: the core's search (`awq_calibrate`: scales, clipping, round to nearest) without
    bias correction; `awq-bc`: with it, as `lmstack quantize --method awq` runs it by default;
  - `gptq-static`: the same scales and clipping search, then GPTQ rounding of the unclipped
    scaled weights with each group's scale and zero fixed beforehand from its clipped range
    (GPTQ's "static groups"; the shipped `rounding: gptq` sets them as it walks);
  - `awq-dense`: the core's search, but each layer calibrates on the dense model's outputs of
    the layers before it (as llm-awq and AutoAWQ propagate), not on the quantized layers';
  - `clip2d`: the same scales, then a joint search over both ends of each (row, group)'s range
    (20 x 20 ratios of its min and max) instead of one shared ratio refined side by side;
  - `flip`: the same scales and clipping search, then the round-to-nearest codes refined by
    greedy flips (one code per row per pass moved to its other neighbour on the grid, the flip
    that lowers the row's e^T H e the most, H the captured inputs' second moments) until no flip
    helps or `--flip-passes` passes; `rtn-flip`: the same flips of plain round-to-nearest codes
    (no scale or clipping search), against `sensitivity`'s round-to-nearest row;
  - `bias-block`: the same scales and clipping, round to nearest, then the core's bias
    correction per layer (o_proj / down_proj take the mean error of the attention block / MLP);
    `bias`: every linear a bias of its own mean error instead; `bias-all`: both.
  `awq` and `awq-bc` also take `--gptq` (the core's GPTQ rounding after the scales instead of
  clipping and rounding to nearest), `--loss-tokens` / `--clip-tokens` (`AWQConfig`'s) and
  `--tune-epochs N` (then the scales and biases tuned end to end, `lmstack.scale_tuning`, as
  `lmstack quantize --method awq` does by default with 4; `--val-samples` more samples are cut
  from the calibration text to pick the epoch, and each epoch's held-out perplexity is printed).

Usage: python benchmarks/awq_variants.py sensitivity
       python benchmarks/awq_variants.py VARIANT [--num-samples 32] [--damping 0.01]  (VARIANT: one of the above)
Prints one JSON line per result, with the CPU it ran on (the numbers depend on it only through
fp32 summation order).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmstack.awq_search import (
    AWQConfig,
    _clip_error,
    _fold,
    _group_size,
    awq_calibrate,
    search_clip,
    search_scales,
)
from lmstack.evaluate import load_stack_with_model, read_text, windows_of
from lmstack.hardware import cpu_description
from lmstack.model.source import open_model_source
from lmstack.quantize import (
    CalibrationModel,
    build_weight_format,
    calibration_samples,
    generate_calibration_text,
    split_validation,
    token_mean,
)
from lmstack_awq.gptq import gptq_int4
from lmstack_awq.int4_math import QMAX, expand_groups, group_params

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "benchmarks/data/heldout_gpl3.txt"
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def perplexity(model: CalibrationModel, ids: list[int], window: int = 512) -> float:
    nll, n = 0.0, 0
    for w in windows_of(ids, window):
        t = torch.tensor(w)[None]
        logits = model.logits(t[:, :-1])[0]
        nll += F.cross_entropy(logits.float(), t[0, 1:], reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def fake_quantize_linears(model: CalibrationModel, fmt, kinds=KINDS) -> None:
    for i in range(model.num_layers):
        for name in model.linear_names(i):
            if any(k in name for k in kinds):
                model.weights[name] = fmt.fake_quantize(model.weights[name])


@torch.no_grad()
def clip_joint(weight: torch.Tensor, x: torch.Tensor, fmt, steps: int = 20) -> torch.Tensor:
    """`weight` clipped per (row, group) to the [r_lo min, r_hi max] with the least d^T C d over
    a steps x steps grid of ratios (1 down to 0.5 each)."""
    out_f, in_f = weight.shape
    g = _group_size(fmt, in_f)
    pad = (-in_f) % g
    groups = (in_f + pad) // g
    xp = F.pad(x.float(), (0, pad)).view(-1, groups, g)
    cov = torch.einsum("ngk,ngl->gkl", xp, xp) / xp.shape[0]
    wp = F.pad(weight, (0, pad)).view(out_f, groups, g)
    wmax = wp.amax(-1, keepdim=True).clamp(min=0)
    wmin = wp.amin(-1, keepdim=True).clamp(max=0)
    best = torch.full((out_f, groups, 1), float("inf"))
    lo_best, hi_best = wmin.clone(), wmax.clone()
    ratios = [1.0 - 0.5 * k / steps for k in range(steps)]
    for r_hi in ratios:
        for r_lo in ratios:
            lo, hi = wmin * r_lo, wmax * r_hi
            err = _clip_error(weight, wp, lo, hi, fmt, cov).unsqueeze(-1)
            better = err < best
            best = torch.where(better, err, best)
            lo_best, hi_best = torch.where(better, lo, lo_best), torch.where(better, hi, hi_best)
    return torch.maximum(torch.minimum(wp, hi_best), lo_best).reshape(out_f, -1)[:, :in_f].contiguous()


@torch.no_grad()
def flip_round(weight: torch.Tensor, h: torch.Tensor, fmt, passes: int, damping: float) -> torch.Tensor:
    """`weight` quantized with round-to-nearest's group scales and zeros, its codes then moved
    one at a time to the other grid neighbour of the value while that lowers e^T H e per row
    (e: the row's weight error; H damped by `damping` x its mean diagonal). Returns the
    dequantized weight. He is kept up to date as codes move (one row of H per flip)."""
    out_f, in_f = weight.shape
    scale, zero = group_params(weight, fmt.scheme)
    g = fmt.scheme.effective_group(in_f)
    s, z = expand_groups(scale, in_f, g), expand_groups(zero.float(), in_f, g)
    u = weight.float() / s + z
    q = u.round().clamp(0, QMAX)
    hd = h.float().clone()
    hd.diagonal().add_(damping * hd.diagonal().mean())
    diag = hd.diagonal()
    e = (q - u) * s
    he = e @ hd
    rows = torch.arange(out_f)
    for _ in range(passes):
        d = torch.where(q > u, -1.0, 1.0)
        step = d * s
        gain = 2 * step * he + step * step * diag  # the change of e^T H e if this code flips
        gain = gain.masked_fill(((q + d) < 0) | ((q + d) > QMAX), float("inf"))
        best, col = gain.min(dim=-1)
        take = best < 0
        if not take.any():
            break
        r, c = rows[take], col[take]
        st = step[r, c]
        q[r, c] += d[r, c]
        e[r, c] += st
        he[r] += st[:, None] * hd[c]
    return (q - z) * s


@torch.no_grad()
def refit_scales(
    weight: torch.Tensor, clipped: torch.Tensor, h: torch.Tensor, fmt, damping: float, rounds: int
) -> torch.Tensor:
    """Round-to-nearest of `clipped` (codes, group scales, zeros), then each row's group scales
    refitted by least squares to `weight` under e^T H e (H damped by `damping` x its mean
    diagonal; zeros kept, scales rounded to fp16 as stored) and the codes rounded again on the new
    scales, `rounds` times; per row, the best of every round by that error. G unknowns per row
    (groups), where GPTQ and the flips move every code. Returns the dequantized weight."""
    out_f, in_f = weight.shape
    g = fmt.scheme.effective_group(in_f)
    w = weight.float()
    scale, zero = group_params(clipped, fmt.scheme)
    groups = scale.shape[1]
    spans = [(j * g, min(in_f, (j + 1) * g)) for j in range(groups)]
    z = expand_groups(zero.float(), in_f, g)
    hd = h.float().clone()
    hd.diagonal().add_(damping * hd.diagonal().mean())

    def dequant(sc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (q - z) * expand_groups(sc, in_f, g)

    def error(wq: torch.Tensor) -> torch.Tensor:
        e = w - wq
        return ((e @ hd) * e).sum(-1)

    q = (clipped.float() / expand_groups(scale, in_f, g) + z).round().clamp(0, QMAX)
    best_w = dequant(scale, q)
    best = error(best_w)
    for _ in range(rounds):
        v = q - z
        vh = [v[:, a:b] @ hd[a:b, :] for a, b in spans]
        lhs = torch.empty(out_f, groups, groups)
        rhs = torch.empty(out_f, groups)
        for i in range(groups):
            rhs[:, i] = (vh[i] * w).sum(-1)
            for j, (c, d) in enumerate(spans):
                lhs[:, i, j] = (vh[i][:, c:d] * v[:, c:d]).sum(-1)
        ridge = 1e-6 * lhs.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)
        lhs.diagonal(dim1=1, dim2=2).add_(ridge[:, None])
        scale = torch.linalg.solve(lhs, rhs.unsqueeze(-1)).squeeze(-1).clamp(min=1e-6).half().float()
        rounded = (w / expand_groups(scale, in_f, g) + z).round().clamp(0, QMAX)  # on the new scales
        for candidate in (dequant(scale, q), dequant(scale, rounded)):
            err = error(candidate)
            better = err < best
            best = torch.where(better, err, best)
            best_w = torch.where(better[:, None], candidate, best_w)
        q = rounded
    return best_w


@torch.no_grad()
def bias_correct(
    model: CalibrationModel,
    i: int,
    x: torch.Tensor,
    dense: dict[str, torch.Tensor],
    quantized: dict[str, torch.Tensor],
    variant: str,
) -> None:
    """Biases for layer i's quantized linears (`model.weights` holds them quantized) that cancel
    mean errors on the calibration inputs x. `bias-block`: the core's bias correction
    (`CalibrationModel.correct_biases`: o_proj and down_proj take the mean error of the attention
    block and of the MLP). `bias`: every linear its own, b = (W - Wq) mean(x_in), in order along
    the layer so that each linear's inputs come from the quantized, corrected ops before it.
    `bias-all`: q/k/v and gate/up their own first, then the blocks'."""
    if variant == "bias-block":
        model.correct_biases(i, x, dense, quantized)
        return
    if variant == "bias-gain":
        fit_gain_and_bias(model, i, x, dense)
        return
    w, p = model.weights, model.prefix(i)
    a, m = p + "self_attn.", p + "mlp."

    def set_bias(name: str, b: torch.Tensor) -> None:
        w[name.removesuffix("weight") + "bias"] = b

    def own(names: list[str], inputs: torch.Tensor) -> None:
        for name in names:
            set_bias(name, (dense[name] - w[name]) @ token_mean(inputs))

    qkv, gate_up = [f"{a}{n}_proj.weight" for n in "qkv"], [f"{m}{n}_proj.weight" for n in ("gate", "up")]
    o, down = a + "o_proj.weight", m + "down_proj.weight"
    h = model._norm(x, p + "input_layernorm.weight")
    dense_attn = model._linear(model._attention(i, h, dense), o, dense)  # before any bias is set
    own(qkv, h)
    o_in = model._attention(i, h, None)
    if variant == "bias":
        own([o], o_in)
        x = x + model._linear(o_in, o, None)
    else:
        got = model._linear(o_in, o, None)
        set_bias(o, token_mean(dense_attn - got))
        x = x + got + w[o.removesuffix("weight") + "bias"]
    h2 = model._norm(x, p + "post_attention_layernorm.weight")
    dense_mlp = model._linear(model._mlp_act(i, h2, dense), down, dense)
    own(gate_up, h2)
    act = model._mlp_act(i, h2, None)
    if variant == "bias":
        own([down], act)
    else:
        set_bias(down, token_mean(dense_mlp - model._linear(act, down, None)))


@torch.no_grad()
def fit_gain_and_bias(
    model: CalibrationModel, i: int, x: torch.Tensor, dense: dict[str, torch.Tensor]
) -> None:
    """o_proj's and down_proj's quantized rows scaled by g and given a bias b per output channel,
    (g, b) the least-squares fit of the dense block's output by g * quantized + b over the
    calibration tokens (the attention block, then the MLP on the corrected attention's output).
    g folds into the rows' group scales: the int4 format holds it."""
    w, p = model.weights, model.prefix(i)
    o, down = p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"

    def fit(want: torch.Tensor, got: torch.Tensor, name: str) -> None:
        want, got = want.reshape(-1, want.shape[-1]).double(), got.reshape(-1, got.shape[-1]).double()
        gm, wm = got.mean(0), want.mean(0)
        g = ((got - gm) * (want - wm)).mean(0) / (got - gm).pow(2).mean(0).clamp(min=1e-30)
        w[name] = w[name] * g.float()[:, None]
        w[name.removesuffix("weight") + "bias"] = (wm - g * gm).float()

    h = model._norm(x, p + "input_layernorm.weight")
    o_in = model._attention(i, h, None)
    fit(model._linear(model._attention(i, h, dense), o, dense), model._linear(o_in, o, None), o)
    x = x + model._linear(o_in, o, None)
    h2 = model._norm(x, p + "post_attention_layernorm.weight")
    act = model._mlp_act(i, h2, None)
    fit(model._linear(model._mlp_act(i, h2, dense), down, dense), model._linear(act, down, None), down)


@torch.no_grad()
def awq_variant(
    model: CalibrationModel,
    samples: torch.Tensor,
    fmt,
    variant: str,
    damping: float,
    flip_passes: int = 256,
    lsq_rounds: int = 3,
) -> None:
    """The core's per-layer AWQ loop (scales, clipping, propagation of quantized outputs) with the
    clipping or rounding step swapped; clipping runs after every scale of the layer is folded,
    which gives what `awq_calibrate` gives (a row's clip ratio does not change when the row is
    scaled)."""
    cfg, weights = AWQConfig(), model.weights
    x = model.embed(samples)
    loss_n = max(1, min(samples.shape[0], cfg.loss_tokens // samples.shape[1]))
    for i in range(model.num_layers):
        dense_out, inputs = model.layer_forward(i, x, capture=True)
        groups = model.scale_groups(i)
        for group in groups:
            if group.prev is not None and variant != "rtn-flip":
                s_prev, _ = search_scales(group, weights, inputs[group.input][:loss_n], fmt, cfg)
                _fold(weights, group.prev, s_prev)
                s = group.expand(s_prev)
                for name in group.linears:
                    weights[name] = weights[name] * s
                inputs[group.input] = inputs[group.input] / s
        quantized = {}
        for group in groups:
            flat = inputs[group.input].reshape(-1, inputs[group.input].shape[-1])
            sub = flat[:: max(1, flat.shape[0] // cfg.clip_tokens)]
            h = flat.float().t() @ flat.float() / flat.shape[0]
            for name in group.linears:
                clipped = weights[name]
                if name in group.clip and variant != "rtn-flip":
                    clipped = (
                        clip_joint(clipped, sub, fmt)
                        if variant == "clip2d"
                        else search_clip(clipped, sub, fmt, cfg)[0]
                    )
                if variant == "lsq":
                    quantized[name] = refit_scales(weights[name], clipped, h, fmt, damping, lsq_rounds)
                elif variant in ("flip", "rtn-flip"):
                    quantized[name] = flip_round(clipped, h, fmt, flip_passes, damping)
                elif variant == "gptq-static":
                    quantized[name] = gptq_int4(
                        weights[name], h, fmt.scheme, torch.float16, ranges_from=clipped, damping=damping
                    ).dequantize()
                else:
                    quantized[name] = fmt.fake_quantize(clipped)
        if variant in ("bias", "bias-block", "bias-all", "bias-gain"):
            dense = {name: weights[name] for name in quantized}
            weights.update(quantized)
            bias_correct(model, i, x, dense, quantized, variant)
            x = model.layer_forward(i, x)[0]
            continue
        weights.update(quantized)
        # awq-dense: the next layer calibrates on the dense model's outputs (llm-awq and AutoAWQ
        # run the layer before its weights change); the others on the quantized layer's.
        x = dense_out if variant == "awq-dense" else model.layer_forward(i, x, quantized)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "what",
        choices=[
            "sensitivity",
            "awq",
            "awq-bc",
            "awq-dense",
            "gptq-static",
            "clip2d",
            "flip",
            "rtn-flip",
            "lsq",
            "bias",
            "bias-block",
            "bias-all",
            "bias-gain",
        ],
    )
    ap.add_argument("--stack", default=str(ROOT / "examples/stacks/cpu.yaml"))
    ap.add_argument("--calibration", default="self", help="a text file, or self (the model's own answers)")
    ap.add_argument("--self-text", default="/tmp/lmstack-awq-self.txt", help="where the self text is kept")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--damping", type=float, default=0.01, help="gptq-static, flip: H's diagonal damping")
    ap.add_argument("--flip-passes", type=int, default=256, help="flip: at most this many flips per row")
    ap.add_argument(
        "--lsq-rounds", type=int, default=3, help="lsq: scale refits (each followed by re-rounding)"
    )
    ap.add_argument("--gptq", action="store_true", help="awq, awq-bc: GPTQ rounding after the scales")
    ap.add_argument(
        "--loss-tokens",
        type=int,
        default=AWQConfig.loss_tokens,
        help="awq, awq-bc: tokens of the scale search's loss",
    )
    ap.add_argument(
        "--clip-tokens",
        type=int,
        default=AWQConfig.clip_tokens,
        help="awq, awq-bc: tokens of the clipping search",
    )
    ap.add_argument("--tune-epochs", type=int, default=0, help="awq, awq-bc: scale tuning epochs")
    ap.add_argument("--val-samples", type=int, default=8, help="with --tune-epochs: validation samples")
    args = ap.parse_args()

    stack = load_stack_with_model(args.stack, None)
    source = open_model_source(stack.model)
    ids = source.tokenizer.encode(read_text(HELDOUT))
    model = CalibrationModel.load(source)
    started = time.perf_counter()

    def report(name: str, value: float, **extra) -> None:
        print(
            json.dumps(
                {"what": name, "perplexity": round(value, 4), "seconds": round(time.perf_counter() - started)}
                | extra
                | cpu_description()
            ),
            flush=True,
        )

    if args.what == "sensitivity":
        base = {k: v.clone() for k, v in model.weights.items()}
        report("dense", perplexity(model, ids))
        for group, kinds in [(128, KINDS), (32, KINDS)] + [(128, (k,)) for k in KINDS]:
            model.weights.update({k: v.clone() for k, v in base.items()})
            fake_quantize_linears(
                model, build_weight_format(stack, "rtn-int4", group, source.config)[0], kinds
            )
            report(f"rtn-int4 g{group} " + ("all" if len(kinds) > 1 else kinds[0]), perplexity(model, ids))
        return

    if args.calibration == "self":
        path = Path(args.self_text)
        if not path.exists():
            path.write_text(generate_calibration_text(stack, 64 * 512), encoding="utf-8")
        text = path.read_text(encoding="utf-8")
    else:
        text = read_text(args.calibration)
    extra = args.val_samples if args.tune_epochs else 0
    samples = calibration_samples(source.tokenizer.encode(text), args.num_samples + extra, 512)
    samples, validation = split_validation(samples, args.num_samples, extra)
    fmt = build_weight_format(stack, "awq", None, source.config)[0]
    if args.what in ("awq", "awq-bc"):
        cfg = AWQConfig(
            bias_correction=args.what == "awq-bc",
            loss_tokens=args.loss_tokens,
            clip_tokens=args.clip_tokens,
            gptq=args.gptq,
            tune_epochs=args.tune_epochs,
            tune_val_samples=args.val_samples,
        )

        def on_epoch(epoch: int, line: dict, linears: dict[str, torch.Tensor]) -> None:
            saved = {n: model.weights[n] for n in linears}
            model.weights.update(linears)
            report(f"{args.what} tuning", perplexity(model, ids), **line)
            model.weights.update(saved)

        awq_calibrate(model, samples, fmt, cfg, on_epoch=on_epoch, validation=validation)
        if not args.gptq and not args.tune_epochs:  # GPTQ and tuning leave them rounded, nearest clipped
            fake_quantize_linears(model, fmt)
    else:
        awq_variant(model, samples, fmt, args.what, args.damping, args.flip_passes, args.lsq_rounds)
    report(args.what, perplexity(model, ids), num_samples=int(samples.shape[0]), calibration=args.calibration)


if __name__ == "__main__":
    main()
