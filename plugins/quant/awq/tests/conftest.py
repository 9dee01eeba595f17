"""Fixtures: int4 checkpoints of the tiny model, written with `Int4WeightFormat` (as
`lmstack quantize` does) or in AutoAWQ's GEMM layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmstack_awq.autoawq import pack_awq_words
from lmstack_awq.int4_format import Int4WeightFormat

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write_ct_checkpoint(dense: Path, out: Path, fmt: Int4WeightFormat) -> Path:
    """A compressed-tensors pack-quantized copy of the dense model folder `dense`."""
    shutil.copytree(dense, out)
    tensors = load_file(str(out / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_linear(name):
            prefix = name.removesuffix("weight")
            for suffix, value in fmt.encode(prefix, t.float()).items():
                written[prefix + suffix] = value
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config(["lm_head"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_autoawq_checkpoint(dense: Path, out: Path, fmt: Int4WeightFormat) -> Path:
    """An AutoAWQ GEMM copy of `dense` holding the same int4 values as `fmt` would write."""
    shutil.copytree(dense, out)
    tensors = load_file(str(out / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_linear(name):
            prefix = name.removesuffix("weight")
            qw = fmt.quantize(t.float())
            written[prefix + "qweight"] = pack_awq_words(qw.q.t().contiguous())
            written[prefix + "qzeros"] = pack_awq_words(qw.zero.t().contiguous())
            written[prefix + "scales"] = qw.scale.t().to(torch.float16).contiguous()
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": fmt.scheme.group_size,
        "zero_point": True,
        "version": "gemm",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory, tiny_model_path):
    """The tiny model as a compressed-tensors and an AutoAWQ int4 checkpoint (rtn-int4, g128)."""
    from lmstack_awq.int4_math import Int4Scheme

    fmt = Int4WeightFormat("rtn-int4", Int4Scheme(128, False))
    root = tmp_path_factory.mktemp("int4")
    return {
        "ct": write_ct_checkpoint(tiny_model_path, root / "ct", fmt),
        "autoawq": write_autoawq_checkpoint(tiny_model_path, root / "autoawq", fmt),
    }
