"""The AWQ search on the tiny model: the scale fold is an exact rewrite of the dense model, and
AWQ's quantized model is closer to the dense one than round-to-nearest at the same group size."""

from __future__ import annotations

import pytest
import torch

from lmstack.model.source import open_model_source
from lmstack.quantize import CalibrationModel
from lmstack_awq.search import AWQCalibration, AWQConfig


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
def outlier_model(tiny_model_path) -> CalibrationModel:
    """The tiny model with a few strong input channels after each norm, like real LLMs' activation
    outliers (the case AWQ is for)."""
    model = CalibrationModel.load(open_model_source(str(tiny_model_path)))
    gen = torch.Generator().manual_seed(1)
    for name, w in model.weights.items():
        if name.endswith("layernorm.weight"):
            idx = torch.randperm(w.shape[0], generator=gen)[:4]
            w[idx] *= 12.0
    return model


def _copy(model: CalibrationModel) -> CalibrationModel:
    return CalibrationModel(model.config, {k: v.clone() for k, v in model.weights.items()})


def _quantized(model: CalibrationModel, fmt: FakeInt4) -> CalibrationModel:
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
    torch.testing.assert_close(model.logits(ids), before, rtol=1e-4, atol=1e-4)


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
