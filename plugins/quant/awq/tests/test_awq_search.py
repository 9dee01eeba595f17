"""The AWQ search on the tiny model: the scale fold is an exact rewrite of the dense model, and
AWQ's quantized model is closer to the dense one than round-to-nearest at the same group size."""

from __future__ import annotations

import pytest
import torch

from lmstack.model.source import open_model_source
from lmstack_awq.search import AWQCalibration, AWQConfig
from lmstack_calibrate.model import DenseModel


class FakeInt4(AWQCalibration):
    """Asymmetric int4 with an integer zero point per group of `group_size` inputs (the last
    group padded): what the search optimises against, without the packing."""

    method = "test-int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        o, i = w.shape
        wg = torch.nn.functional.pad(w, (0, (-i) % self.group_size)).view(o, -1, self.group_size)
        hi, lo = wg.amax(-1, keepdim=True).clamp(min=0), wg.amin(-1, keepdim=True).clamp(max=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-lo / scale).round()
        q = (wg / scale + zero).round().clamp(0, 15)
        return ((q - zero) * scale).view(o, -1)[:, :i]


@pytest.fixture(scope="module")
def outlier_model(tiny_model_path) -> DenseModel:
    """The tiny model with a few strong input channels after each norm, like real LLMs' activation
    outliers (the case AWQ is for)."""
    model = DenseModel.load(open_model_source(str(tiny_model_path)))
    gen = torch.Generator().manual_seed(1)
    for name, w in model.weights.items():
        if name.endswith("layernorm.weight"):
            idx = torch.randperm(w.shape[0], generator=gen)[:4]
            w[idx] *= 12.0
    return model


def _copy(model: DenseModel) -> DenseModel:
    return DenseModel(model.config, {k: v.clone() for k, v in model.weights.items()})


def _quantized(model: DenseModel, fmt: FakeInt4) -> DenseModel:
    q = _copy(model)
    for name in q.all_linear_names():
        q.weights[name] = fmt.fake_quantize(q.weights[name])
    return q


def _samples(seed: int, n: int = 8, length: int = 64) -> torch.Tensor:
    return torch.randint(0, 200, (n, length), generator=torch.Generator().manual_seed(seed))


def test_scale_fold_keeps_the_dense_model(outlier_model):
    model = _copy(outlier_model)
    fmt = FakeInt4(32)
    fmt.awq = AWQConfig(grid=10, clip=False)
    ids = _samples(0)
    before = model.logits(ids)
    fmt.calibrate(model, _samples(1))
    assert any(rec["attn_in"]["alpha"] > 0 for rec in fmt.awq.history)  # some scale was applied
    changed = [n for n in model.weights if not torch.equal(model.weights[n], outlier_model.weights[n])]
    assert any("layernorm" in n for n in changed)
    # The tiny model has grouped-query attention (4 query heads, 2 KV heads): o_proj's scale
    # folds into v_proj's rows, one per row repeated over the query heads that share it.
    assert model.config.num_heads > model.config.num_kv_heads
    assert any("v_proj" in n for n in changed) and any("o_proj" in n for n in changed)
    # Up to fp32 rounding: the model's native RMSNorm sums in its own order (max |logit| ~18 here).
    torch.testing.assert_close(model.logits(ids), before, rtol=1e-4, atol=2e-4)


def test_awq_beats_round_to_nearest(outlier_model):
    fmt = FakeInt4(32)
    fmt.awq = AWQConfig(grid=10, clip_grid=10)
    held_out = _samples(2)
    dense = outlier_model.logits(held_out)
    rtn_err = (_quantized(outlier_model, fmt).logits(held_out) - dense).pow(2).mean()
    model = _copy(outlier_model)
    fmt.calibrate(model, _samples(3))
    awq_err = (_quantized(model, fmt).logits(held_out) - dense).pow(2).mean()
    assert awq_err < 0.7 * rtn_err
    record = fmt.calibration_record()
    assert record["algorithm"] == "awq" and len(record["layers"]) == model.num_layers


@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_rounding_beats_round_to_nearest_on_the_layer_output(symmetric):
    from lmstack_awq.gptq import gptq_int4
    from lmstack_awq.int4_math import Int4Scheme, quantize_int4

    gen = torch.Generator().manual_seed(4)
    in_f = int(torch.randint(70, 200, (1,), generator=gen))  # odd sizes: a partial last group
    w = torch.randn(48, in_f, generator=gen)
    mix = torch.randn(in_f, in_f, generator=gen) * 0.3
    x = torch.randn(3000, in_f, generator=gen) @ mix + torch.randn(3000, in_f, generator=gen)
    h = x.t() @ x / x.shape[0]
    scheme = Int4Scheme(32, symmetric)
    gptq, rtn = gptq_int4(w, h, scheme, torch.float16), quantize_int4(w, scheme)
    assert gptq.q.max() <= 15 and gptq.scale.shape == rtn.scale.shape
    err = [(x @ (q.dequantize() - w).t()).pow(2).mean() for q in (gptq, rtn)]
    assert err[0] < 0.8 * err[1]


def test_gptq_static_groups_take_their_ranges_from_the_given_weight():
    from lmstack_awq.gptq import gptq_int4
    from lmstack_awq.int4_math import Int4Scheme, group_params

    gen = torch.Generator().manual_seed(6)
    in_f = int(torch.randint(70, 200, (1,), generator=gen))
    w = torch.randn(24, in_f, generator=gen)
    x = torch.randn(2000, in_f, generator=gen)
    h = x.t() @ x / x.shape[0]
    scheme = Int4Scheme(32, False)
    clipped = w.clamp(-1.0, 1.0)
    static = gptq_int4(w, h, scheme, torch.float16, ranges_from=clipped)
    scale, zero = group_params(clipped, scheme)
    torch.testing.assert_close(static.scale, scale, rtol=0, atol=0)
    assert torch.equal(static.zero, zero)
    walked = gptq_int4(w, h, scheme, torch.float16)  # ranges from the updated, unclipped weights
    assert not torch.equal(walked.scale, scale)


def test_gptq_rounded_linears_are_written_as_rounded():
    from lmstack_awq.int4_format import Int4WeightFormat, decode_ct_codes, decode_ct_zero
    from lmstack_awq.int4_math import Int4Scheme, dequantize_int4

    fmt = Int4WeightFormat("awq", Int4Scheme(64, False))
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 200, generator=gen)
    x = torch.randn(500, 200, generator=gen)
    rounded = fmt.gptq("layers.0.proj", w, x.t() @ x / 500)
    t = fmt.encode("layers.0.proj", w)
    codes = decode_ct_codes(t["weight_packed"], (40, 200))
    zero = decode_ct_zero(t["weight_zero_point"], 40, t["weight_scale"].shape[1])
    back = dequantize_int4(codes, t["weight_scale"].float(), zero, 64, torch.float32)
    torch.testing.assert_close(back, rounded, rtol=0, atol=0)


def _block_errors(model: DenseModel, dense: DenseModel, fmt: FakeInt4, ids: torch.Tensor):
    """Layer 0's attention block and MLP output errors (dense minus quantized) [N, H] on `ids`,
    the MLP's input taken after the quantized attention, as served."""
    quantized = {n: fmt.fake_quantize(model.weights[n]) for n in model.linear_names(0)}
    x = model.embed(ids)
    got = model.attention(0, model.norm(0, "input_layernorm", x), quantized)
    want = dense.attention(0, dense.norm(0, "input_layernorm", x))
    x2 = x + got
    mlp_got = model.mlp(0, model.norm(0, "post_attention_layernorm", x2), quantized)
    mlp_want = dense.mlp(0, dense.norm(0, "post_attention_layernorm", x2))
    return (want - got).reshape(-1, x.shape[-1]), (mlp_want - mlp_got).reshape(-1, x.shape[-1])


def test_bias_correction_cancels_each_blocks_mean_error(outlier_model):
    """With `bias_correction`, o_proj and down_proj gain biases under which layer 0's attention
    block and MLP make no error on average over the calibration tokens (their inputs are the
    same as the dense model's there); without, the mean error is far from zero. (Whether that
    helps on held-out text is a property of the model: measured on SmolLM2-135M, README.)"""
    fmt = FakeInt4(32)
    fmt.awq = AWQConfig(grid=4, clip_grid=4, bias_correction=True)
    calibration = _samples(7)
    model = _copy(outlier_model)
    fmt.calibrate(model, calibration)
    assert fmt.calibration_record()["bias_correction"] is True
    biased = {n for n in model.weights if n.endswith(".bias")}
    assert biased == {
        f"{model.prefix(i)}{n}.bias" for i in range(2) for n in ("self_attn.o_proj", "mlp.down_proj")
    }
    attn_err, mlp_err = _block_errors(model, outlier_model, fmt, calibration)
    plain = _copy(model)
    for n in biased:
        del plain.weights[n]
    plain_attn, plain_mlp = _block_errors(plain, outlier_model, fmt, calibration)
    for err, before in ((attn_err, plain_attn), (mlp_err, plain_mlp)):
        scale = before.mean(0).abs().max()
        assert scale > 1e-3 * before.abs().mean()  # there was a mean error to cancel
        assert err.mean(0).abs().max() < 1e-3 * scale


def _kl_to(dense: DenseModel, model: DenseModel, ids: torch.Tensor) -> float:
    t = torch.log_softmax(dense.logits(ids), -1)
    s = torch.log_softmax(model.logits(ids), -1)
    return (t.exp() * (t - s)).sum(-1).mean().item()


def test_scale_tuning_moves_only_scales_and_biases_towards_the_dense_model(outlier_model):
    """With `tune_epochs`, the search's codes and zero points stay as round-to-nearest left them,
    the fp16 group scales move, the held-out samples of the calibration set pick the epoch, and
    the tuned model is closer to the dense one (KL) than the untuned one, on samples that
    neither the search nor the tuning saw. The folder's tensors are the tuned linears exactly."""
    from lmstack_awq.int4_format import decode_ct_codes, decode_ct_zero
    from lmstack_awq.int4_math import Int4Scheme, dequantize_int4
    from lmstack_awq.search import AwqWeightFormat

    class Recording(AwqWeightFormat):
        start: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def tune_start(self, name, weight):
            codes, scales, group = super().tune_start(name, weight)
            qw = self.rounded[name]
            self.start[name] = (qw.q.clone(), scales.clone())
            return codes, scales, group

    calibration, unseen = _samples(11, n=10), _samples(12, n=4)
    runs = {}
    for epochs in (0, 3):
        fmt = Recording(
            Int4Scheme(32, False),
            AWQConfig(grid=4, clip_grid=4, bias_correction=True, tune_epochs=epochs, tune_lr=3e-3),
        )
        model = _copy(outlier_model)
        assert fmt.validation_samples == (8 if epochs else 0)
        fmt.calibrate(model, calibration[:8], validation=calibration[8:] if epochs else None)
        if epochs == 0:
            for n in model.all_linear_names():
                model.weights[n] = fmt.fake_quantize(model.weights[n])
        runs[epochs] = (fmt, model)
    fmt, tuned = runs[3]
    record = fmt.calibration_record()["scale_tuning"]
    assert record["train_samples"] == 8 and record["val_samples"] == 2
    assert [h["epoch"] for h in record["history"]] == [0, 1, 2, 3]
    best = min(record["history"], key=lambda h: h["val_kl"])
    assert record["best_epoch"] == best["epoch"] > 0
    # The folder holds the codes the search's rounding gave, the tuned scales, and exactly the
    # weights the tuned model computes with.
    name = "model.layers.1.mlp.down_proj"
    codes, scales = fmt.start[name]
    qw = fmt.rounded[name]
    t = fmt.encode(name, tuned.weights[name + ".weight"])
    out, cols = qw.q.shape
    assert torch.equal(decode_ct_codes(t["weight_packed"], (out, cols)), codes)
    assert torch.equal(decode_ct_zero(t["weight_zero_point"], out, t["weight_scale"].shape[1]), qw.zero)
    assert not torch.equal(t["weight_scale"].float(), scales)
    back = dequantize_int4(codes, t["weight_scale"].float(), qw.zero, 32, torch.float32)
    torch.testing.assert_close(back, tuned.weights[name + ".weight"], rtol=0, atol=0)
    assert _kl_to(outlier_model, tuned, unseen) < _kl_to(outlier_model, runs[0][1], unseen)
