"""What a user can get wrong with an int4 checkpoint fails before serving, in one line that
names the tensor or the scheme; and what the compact embedding / head option swaps in."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from lmstack.errors import LmstackError
from lmstack.testing.kit import tiny_stack


def _llm(path, **quant):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    return LLM(tiny_stack(path, quant={"weights": "awq", **quant}), plugin_manager=make_plugin_manager())


def _edit_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))


def _copy(src, tmp_path):
    import shutil

    return shutil.copytree(src, tmp_path / "m")


def test_a_missing_scale_is_named(int4_models, tmp_path):
    folder = _copy(int4_models["ct"], tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        LmstackError, match=r"lacks weights for layers\.1\.qkv_proj\.weight_scale \(2 of 3 parts\)"
    ):
        _llm(folder)


def test_a_shape_not_matching_config_json_is_named(int4_models, tmp_path):
    folder = _copy(int4_models["ct"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        LmstackError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight_\w+.*(expected|does not match)"
    ):
        _llm(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "3-bit int weights"),
        (
            lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
            "quantizes activations",
        ),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "strategy 'block'"),
    ],
)
def test_an_unknown_scheme_is_named(int4_models, tmp_path, edit, message):
    folder = _copy(int4_models["ct"], tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(LmstackError, match=message):
        _llm(folder)


def test_rtn_int4_on_a_quantized_checkpoint_names_the_format(int4_models):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    stack = tiny_stack(int4_models["ct"], quant={"weights": "rtn-int4"})
    with pytest.raises(LmstackError, match="compressed-tensors/pack-quantized"):
        LLM(stack, plugin_manager=make_plugin_manager())


def test_auto_picks_awq_for_an_int4_checkpoint(int4_models):
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import default_registry
    from lmstack.stack.resolve import resolve

    resolved = resolve(load_stack(tiny_stack(int4_models["autoawq"])), default_registry())
    assert resolved.quantizer.name == "awq" and resolved.checkpoint_format == "autoawq/gemm"


@pytest.mark.parametrize("mode", ["int8", "int4", "dense"])
def test_compact_head_and_embedding(tmp_path, mode):
    """The tied embedding / head swapped for one compact table (or left dense)."""
    import torch

    from lmstack.testing.tiny_model import write_tiny_model
    from lmstack_awq.compact import CompactEmbedding, CompactHead

    path = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    llm = _llm_rtn(path, lm_head=mode)
    model = llm.engine.executor.runner.model if hasattr(llm.engine.executor, "runner") else None
    if model is None:
        pytest.skip("executor does not expose the model")
    if mode == "dense":
        assert isinstance(model.embed_tokens, torch.nn.Embedding)
    else:
        assert isinstance(model.embed_tokens, CompactEmbedding) and isinstance(model.lm_head, CompactHead)
        assert model.embed_tokens.table is model.lm_head.table  # one copy for the tied pair
    llm.engine.shutdown()


def _llm_rtn(path, **options):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    return LLM(
        tiny_stack(path, quant={"weights": "rtn-int4", **options}), plugin_manager=make_plugin_manager()
    )
