"""AWQ (with bias correction, as `lmstack quantize --method awq` runs it), then the int4 group
scales tuned end to end: the quantized model distilled towards the dense one over the
calibration text, with the codes and zero points frozen.

The search of `benchmarks/awq_variants.py awq-bc` gives every linear its scales, clipping and
codes layer by layer; each layer's choice is blind to what the later layers and the head make
of its error. Here the fp16 group scales (one per row and 128 columns, 1/128 of the weights) —
and o_proj / down_proj's biases, with `--norms` the RMSNorm weights too — are moved by Adam on
the KL divergence from the dense model's next-token distribution, on the same 32 calibration
samples the search used. The number of epochs is chosen by the KL on validation samples taken
from the calibration file after those 32 (not the held-out text): the epoch with the least
validation KL is kept.

Perplexity: fp32, `benchmarks/data/heldout_gpl3.txt` in 512-token windows, tied head dense (as
`awq_variants.py`).

Usage: python benchmarks/awq_e2e.py [--epochs 4] [--lr 1e-3] [--norms]
         [--calibration benchmarks/data/calibration_docs.txt] [--num-samples 32] [--val-samples 8]
Prints one JSON line per epoch and one with the result, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmstack.awq_search import AWQConfig, awq_calibrate
from lmstack.evaluate import load_stack_with_model, read_text, windows_of
from lmstack.hardware import cpu_description
from lmstack.model.source import open_model_source
from lmstack.quantize import CalibrationModel, build_weight_format, calibration_samples
from lmstack_awq.int4_math import expand_groups

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "benchmarks/data/heldout_gpl3.txt"


def head_logits(model: CalibrationModel, x: torch.Tensor) -> torch.Tensor:
    x = model._norm(x, "model.norm.weight")
    head = model.weights.get("lm_head.weight", model.weights["model.embed_tokens.weight"])
    return F.linear(x, head)


def forward(model: CalibrationModel, ids: torch.Tensor, linears: dict[str, torch.Tensor]) -> torch.Tensor:
    x = model.embed(ids)
    for i in range(model.num_layers):
        x, _ = model.layer_forward(i, x, {n: linears[n] for n in model.linear_names(i)})
    return head_logits(model, x)


@torch.no_grad()
def perplexity(model: CalibrationModel, ids: list[int], window: int = 512) -> float:
    nll, n = 0.0, 0
    for w in windows_of(ids, window):
        t = torch.tensor(w)[None]
        logits = model.logits(t[:, :-1])[0]
        nll += F.cross_entropy(logits.float(), t[0, 1:], reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student)."""
    logp = F.log_softmax(student_logits.float(), -1).view(-1, student_logits.shape[-1])
    t = teacher_logp.float().view(-1, teacher_logp.shape[-1])
    return (t.exp() * (t - logp)).sum(-1).mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", default=str(ROOT / "examples/stacks/cpu.yaml"))
    ap.add_argument("--calibration", default=str(ROOT / "benchmarks/data/calibration_docs.txt"))
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--val-samples", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam's step on the log of each scale")
    ap.add_argument("--bias-lr", type=float, default=1e-3)
    ap.add_argument("--norms", action="store_true", help="tune the RMSNorm weights too (log scale)")
    ap.add_argument("--cache", default="/tmp/lmstack-awq-bc-weights.pt", help="the AWQ search's result")
    ap.add_argument("--heldout-each-epoch", action="store_true", help="print held-out perplexity per epoch")
    args = ap.parse_args()
    torch.manual_seed(0)

    stack = load_stack_with_model(args.stack, None)
    source = open_model_source(stack.model)
    heldout = source.tokenizer.encode(read_text(HELDOUT))
    model = CalibrationModel.load(source)
    fmt = build_weight_format(stack, "awq", None, source.config)[0]
    cal = source.tokenizer.encode(read_text(args.calibration))
    allsamples = calibration_samples(cal, args.num_samples + args.val_samples, 512)
    train, val = allsamples[: args.num_samples], allsamples[args.num_samples :]
    if val.shape[0] < args.val_samples:
        raise SystemExit(f"the calibration text holds only {allsamples.shape[0]} samples")
    started = time.perf_counter()

    def report(**fields) -> None:
        line = {"seconds": round(time.perf_counter() - started)} | fields | cpu_description()
        print(json.dumps(line), flush=True)

    with torch.no_grad():  # the dense model's next-token distributions (fp16 log-probs)
        teacher = [F.log_softmax(model.logits(s[None])[0], -1).half() for s in allsamples]
    t_train, t_val = teacher[: args.num_samples], teacher[args.num_samples :]

    cache = Path(args.cache)
    if cache.exists():
        model.weights = torch.load(cache)
    else:
        awq_calibrate(model, train, fmt, AWQConfig(bias_correction=True))
        torch.save(model.weights, cache)
    report(stage="awq-bc search done")

    # Frozen codes and zeros; the scales' logs are the parameters.
    names = model.all_linear_names()
    codes, base, theta = {}, {}, {}
    for n in names:
        qw = fmt.quantize(model.weights[n])
        g = qw.group_size
        codes[n] = qw.q.float() - expand_groups(qw.zero.float(), qw.q.shape[1], g)
        base[n] = qw.scale.float()
        theta[n] = torch.zeros_like(base[n], requires_grad=True)
    group = fmt.scheme.effective_group

    def linears() -> dict[str, torch.Tensor]:
        return {
            n: codes[n] * expand_groups(base[n] * theta[n].exp(), codes[n].shape[1], group(codes[n].shape[1]))
            for n in names
        }

    biases = [k for k in model.weights if k.endswith("_proj.bias")]
    for k in biases:
        model.weights[k] = model.weights[k].clone().requires_grad_(True)
    norm_names = [k for k in model.weights if k.endswith("norm.weight")] if args.norms else []
    norm_base = {k: model.weights[k].clone() for k in norm_names}
    phi = {k: torch.zeros_like(norm_base[k], requires_grad=True) for k in norm_names}

    def set_norms() -> None:
        for k in norm_names:
            model.weights[k] = norm_base[k] * phi[k].exp()

    groups = [{"params": list(theta.values()), "lr": args.lr}]
    groups.append({"params": [model.weights[k] for k in biases], "lr": args.bias_lr})
    if norm_names:
        groups.append({"params": list(phi.values()), "lr": args.lr})
    opt = torch.optim.Adam(groups)

    def snapshot() -> dict[str, torch.Tensor]:
        state = {f"theta:{n}": t.detach().clone() for n, t in theta.items()}
        state |= {f"bias:{k}": model.weights[k].detach().clone() for k in biases}
        return state | {f"phi:{k}": p.detach().clone() for k, p in phi.items()}

    def restore(state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n in names:
                theta[n].copy_(state[f"theta:{n}"])
            for k in biases:
                model.weights[k].copy_(state[f"bias:{k}"])
            for k in norm_names:
                phi[k].copy_(state[f"phi:{k}"])

    @torch.no_grad()
    def val_kl() -> float:
        set_norms()
        w = linears()
        return sum(kl(forward(model, s[None], w), t).item() for s, t in zip(val, t_val)) / len(val)

    @torch.no_grad()
    def heldout_ppl() -> float:
        set_norms()
        w = linears()
        saved = {n: model.weights[n] for n in names}
        model.weights.update(w)
        try:
            return perplexity(model, heldout)
        finally:
            model.weights.update(saved)

    best_kl, best_epoch, best = val_kl(), 0, snapshot()
    line = {"epoch": 0, "val_kl": round(best_kl, 5)}
    if args.heldout_each_epoch:
        line["heldout_perplexity"] = round(heldout_ppl(), 4)
    report(**line)
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train)).tolist()
        total = 0.0
        for j in order:
            set_norms()
            loss = kl(forward(model, train[j][None], linears()), t_train[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        v = val_kl()
        line = {"epoch": epoch, "train_kl": round(total / len(train), 5), "val_kl": round(v, 5)}
        if args.heldout_each_epoch:
            line["heldout_perplexity"] = round(heldout_ppl(), 4)
        report(**line)
        if v < best_kl:
            best_kl, best_epoch, best = v, epoch, snapshot()
    restore(best)
    # As a checkpoint stores them: scales in fp16.
    with torch.no_grad():
        for n in names:
            theta[n].copy_(((base[n] * theta[n].exp()).half().float() / base[n]).log())
    report(
        what="awq-bc-e2e",
        perplexity=round(heldout_ppl(), 4),
        best_epoch=best_epoch,
        val_kl=round(best_kl, 5),
        epochs=args.epochs,
        lr=args.lr,
        bias_lr=args.bias_lr,
        norms=args.norms,
        num_samples=int(train.shape[0]),
        val_samples=int(val.shape[0]),
        calibration=args.calibration,
    )


if __name__ == "__main__":
    main()
