"""nvfp4 beyond the kit: nvfp4-pack-quantized checkpoints (ours, W4A4 ones, broken ones),
tensor-parallel shards, compressed-tensors interop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearSpec
from lmstack.model.weight_loader import load_named_weights
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import KIT_PROMPTS, generate, tiny_stack
from lmstack.testing.quantizer import write_quantized_folder
from lmstack_nvfp4 import nvfp4
from lmstack_nvfp4.linear import Nvfp4Linear
from lmstack_nvfp4.quantizer import make_quantizer
from lmstack_nvfp4.scheme import SCALE_SEARCH, Nvfp4WeightFormat, parse_scheme


def _layer(spec: LinearSpec, from_checkpoint: bool = False, input_scales: bool = False) -> nn.Module:
    holder = nn.Module()
    holder.proj = Nvfp4Linear(spec, from_checkpoint, "dequant", SCALE_SEARCH, input_scales)
    return holder


def _load(holder: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Checkpoint names `proj.<part>.<suffix>` -> the layer's parameters, as the model loader does."""

    def name_map(name: str):
        _, part, suffix = name.split(".", 2)
        return f"proj.{suffix}", (int(part) if part.isdigit() else None)

    load_named_weights(holder, tensors.items(), name_map)


def _logprobs(llm) -> list[list[float]]:
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = generate(llm, list(KIT_PROMPTS), sp)
    return [[lp[ids] for lp, ids in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]


def test_written_checkpoint_serves_as_quantizing_at_load(tiny_model_path, tmp_path):
    """An nvfp4-pack-quantized folder we write scores every prompt token exactly as the dense
    model quantized at load does (the same codes and scales)."""
    from lmstack.engine.llm import LLM

    folder = write_quantized_folder(tiny_model_path, tmp_path / "nvfp4", Nvfp4WeightFormat())
    served = LLM(tiny_stack(folder, quant={"weights": "nvfp4"}))
    at_load = LLM(tiny_stack(tiny_model_path, quant={"weights": "nvfp4"}))
    for a, b in zip(_logprobs(served), _logprobs(at_load)):
        assert a == pytest.approx(b, abs=1e-5)
    served.engine.shutdown()
    at_load.engine.shutdown()


def test_w4a4_checkpoint_loads_fused_parts_with_their_global_scales():
    """Each part of a fused projection has its own global scale; a W4A4 checkpoint's
    input_global_scale is read (activations stay in the model dtype)."""
    config = Nvfp4WeightFormat().quantization_config(["lm_head"])
    config["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 4,
        "type": "float",
        "dynamic": "local",
    }
    assert make_quantizer(config, "cpu").input_scales
    spec = LinearSpec(48, 40, False, "layers.0.gate_up_proj", (24, 16), "column", torch.float32)
    holder = _layer(spec, from_checkpoint=True, input_scales=True)
    tensors, dense = {}, []
    for i, n in enumerate((24, 16)):
        w = torch.randn(n, 48) * (i + 1) * 10
        for suffix, t in Nvfp4WeightFormat().encode("x", w).items():
            tensors[f"proj.{i}.{suffix}"] = t
        tensors[f"proj.{i}.input_global_scale"] = torch.tensor([100.0])
        dense.append(Nvfp4WeightFormat().fake_quantize(w))
    _load(holder, tensors)
    x = torch.randn(3, 48)
    torch.testing.assert_close(holder.proj(x), x @ torch.cat(dense).T, rtol=1e-5, atol=1e-4)


def test_broken_checkpoints_name_the_tensor():
    spec = LinearSpec(32, 16, False, "layers.0.o_proj", (16,), "row", torch.float32)
    t = Nvfp4WeightFormat().encode("x", torch.randn(16, 32))
    with pytest.raises(ConfigError, match=r"proj\.weight_global_scale"):
        _load(
            _layer(spec, True),
            {"proj.x.weight_packed": t["weight_packed"], "proj.x.weight_scale": t["weight_scale"]},
        )
    with pytest.raises(ConfigError, match=r"'proj\.x\.weight_scale'.*one scale per 16 inputs"):
        _load(
            _layer(spec, True),
            {**{f"proj.x.{k}": v for k, v in t.items()}, "proj.x.weight_scale": t["weight_scale"][:, :1]},
        )
    with pytest.raises(ConfigError, match=r"'proj\.x\.weight_packed'.*expected shape \(16, 16\)"):
        _load(
            _layer(spec, True),
            {**{f"proj.x.{k}": v for k, v in t.items()}, "proj.x.weight_packed": t["weight_packed"][:, :4]},
        )
    config = Nvfp4WeightFormat().quantization_config(["lm_head"])
    config["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(ConfigError, match=r"config_groups\.group_0\.weights is .*\(4, 'float', 32, True\)"):
        parse_scheme(config)
    with pytest.raises(ConfigError, match=r"linear layers\.0\.q_proj has 40 inputs"):
        Nvfp4WeightFormat().encode("layers.0.q_proj", torch.randn(8, 40))


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_tensor_parallel_shards_make_the_whole_layer(parallel):
    """Each rank keeps only its shard (column: rows of every part; row: whole input groups), and
    the shards' outputs (concatenated per part / summed) are the unsplit layer's."""
    sizes, inp, tp = (32, 16), 64, 2
    weights = {f"proj.{i}.weight": torch.randn(n, inp) for i, n in enumerate(sizes)}
    weights |= {f"proj.{i}.bias": torch.randn(n) for i, n in enumerate(sizes)}

    def spec(rank: int, size: int) -> LinearSpec:
        return LinearSpec(inp, sum(sizes), True, "layers.0.proj", sizes, parallel, torch.float32, rank, size)

    whole = _layer(spec(0, 1))
    _load(whole, weights)
    assert make_quantizer(None, "cpu").shard_alignment(spec(0, tp)) == (16 if parallel == "row" else 1)
    x = torch.randn(4, inp)
    outs = []
    for rank in range(tp):
        shard = _layer(spec(rank, tp))
        _load(shard, weights)
        local = spec(rank, tp)
        assert shard.proj.weight.shape == (local.local_out_features, local.local_in_features // 2)
        xin = x[:, rank * inp // tp : (rank + 1) * inp // tp] if parallel == "row" else x
        outs.append(shard.proj(xin))
    if parallel == "row":
        got = sum(outs)
    else:  # rank outputs are [part0 shard, part1 shard]: regroup by part
        pieces = [o.split([n // tp for n in sizes], dim=1) for o in outs]
        got = torch.cat([torch.cat([p[i] for p in pieces], dim=1) for i in range(len(sizes))], dim=1)
    torch.testing.assert_close(got, whole.proj(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple"):
        Nvfp4Linear(LinearSpec(48, 8, False, "l", (8,), "row", torch.float32, 0, 2), False, "dequant", (1.0,))


def test_compressed_tensors_reads_what_we_write():
    """compressed-tensors parses our config as its NVFP4A16 preset and decompresses our tensors
    (its unpacking, its global-scale division) into the weights we serve."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    config = QuantizationConfig.model_validate(Nvfp4WeightFormat().quantization_config(["lm_head"]))
    scheme = config.config_groups["group_0"]
    assert scheme.weights == preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    w = torch.randn(24, 64)
    tensors = Nvfp4WeightFormat().encode("layers.0.q_proj", w)
    compressor = BaseCompressor.get_value_from_registry(config.format)
    theirs = compressor.decompress(dict(tensors), scheme)["weight"]
    # It decodes in bf16 (its default): equal to ours up to bf16 rounding.
    torch.testing.assert_close(theirs.float(), Nvfp4WeightFormat().fake_quantize(w), rtol=2**-7, atol=1e-6)
    assert nvfp4.GROUP * tensors["weight_scale"].shape[1] == 2 * tensors["weight_packed"].shape[1] == 64
