"""The tiny model (tied embedding / head, as SmolLM2's) served with `quant: {weights: int8}`:
one int8 table for the embedding and head, a byte a weight plus a scale per row, scoring text like the
unquantized model; `lm_head: dense` keeps them dense; the example stack resolves."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import KIT_PROMPTS, generate, reference_llm, tiny_stack
from lmstack_int8.head import Int8Embedding
from lmstack_int8.linear import Int8Linear

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "stacks" / "cpu-int8.yaml"


@pytest.fixture(scope="module")
def tied_model_path(tmp_path_factory):
    from lmstack.testing.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True)


def _llm(path, **quant):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    return LLM(tiny_stack(path, quant={"weights": "int8", **quant}), plugin_manager=make_plugin_manager())


def _model(llm) -> nn.Module:
    return llm.engine.executor.runner.model


def int8_bytes_per_weight(model: nn.Module) -> float:
    """Bytes the model's int8 layers hold (codes and scales; a shared table once) per weight."""
    tables = {id(m): m for m in model.modules() if isinstance(m, Int8Linear)}.values()
    total = sum(m.weight.nbytes + m.weight_scale.nbytes for m in tables)
    return total / sum(m.weight.numel() for m in tables)


def test_tied_table_is_one_int8_copy_and_scores_like_unquantized(tied_model_path):
    llm = _llm(tied_model_path)
    model = _model(llm)
    assert isinstance(model.embed_tokens, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head is model.embed_tokens.table
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 1 + 2 * 4  # the table; qkv, o, gate_up, down of two layers
    dense_2d = [n for n, p in model.named_parameters() if p.dim() == 2 and p.dtype != torch.int8]
    assert dense_2d == []
    # 1 byte a code plus a 4-byte scale per row of 64 (SmolLM2's rows of 576: 1.007).
    assert int8_bytes_per_weight(model) <= 1 + 4 / 64

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ref = reference_llm(tiny_stack(tied_model_path))
    ours, theirs = generate(llm, list(KIT_PROMPTS), sp), generate(ref, list(KIT_PROMPTS), sp)
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        ids = b.prompt_token_ids
        for pos in range(1, len(ids)):
            p, q = math.exp(a.prompt_logprobs[pos][ids[pos]]), math.exp(b.prompt_logprobs[pos][ids[pos]])
            worst = max(worst, abs(p - q))
    assert worst < 0.02, f"token probabilities differ by up to {worst:.4f}"
    llm.engine.shutdown()


def test_lm_head_dense_keeps_embedding_and_head(tied_model_path):
    llm = _llm(tied_model_path, lm_head="dense")
    model = _model(llm)
    assert isinstance(model.embed_tokens, nn.Embedding) and not isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert any(isinstance(m, Int8Linear) for m in model.layers.modules())
    llm.engine.shutdown()


def test_quantized_checkpoints_are_refused():
    from types import SimpleNamespace

    from lmstack.testing.components import TINY_MODEL_CONFIG
    from lmstack_int8.plugin import Int8Options
    from lmstack_int8.quantizer import Int8Quantizer

    awq = {"quant_method": "awq", "bits": 4, "version": "gemm"}
    ctx = SimpleNamespace(model_config=dataclasses.replace(TINY_MODEL_CONFIG, quantization=awq))
    with pytest.raises(ConfigError, match="int8 quantizes dense or GGUF checkpoints.*autoawq/gemm"):
        Int8Quantizer(Int8Options(), ctx)


def test_example_stack_resolves():
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import default_registry
    from lmstack.stack.resolve import resolve

    resolved = resolve(load_stack(EXAMPLE), default_registry(), check_device=False)
    quantizer = resolved.selected["quantizer"]
    assert quantizer.component.name == "int8" and quantizer.options.lm_head == "int8"
    assert resolved.checkpoint_format == "gguf"


@pytest.mark.parametrize(
    "options, reason",
    [
        (
            {"activations": "int8", "kernel": "torch"},
            "activations: int8 runs in this plugin's C\\+\\+ kernel",
        ),
        ({"activations": "int8", "fp32_activations": "exact"}, "fp32_activations: exact asks for none"),
        ({"activations": "int8", "dtype": torch.bfloat16}, "this stack is bfloat16 on cpu"),
        ({"activations": "int8", "device": "cuda"}, "this stack is float32 on cuda"),
    ],
)
def test_contradicting_activation_options_are_refused(options, reason):
    """Nothing silently ignored: int8 activations exist only in the CPU kernel for fp32 stacks."""
    from types import SimpleNamespace

    from lmstack.testing.components import TINY_MODEL_CONFIG
    from lmstack_int8.plugin import Int8Options
    from lmstack_int8.quantizer import Int8Quantizer

    options = dict(options)
    where = {"device": options.pop("device", "cpu"), "dtype": options.pop("dtype", torch.float32)}
    ctx = SimpleNamespace(
        model_config=TINY_MODEL_CONFIG, device=torch.device(where["device"]), dtype=where["dtype"]
    )
    with pytest.raises(ConfigError, match=reason):
        Int8Quantizer(Int8Options(**options), ctx)
    Int8Quantizer(
        Int8Options(activations="int8"),
        SimpleNamespace(model_config=TINY_MODEL_CONFIG, device=torch.device("cpu"), dtype=torch.float32),
    )
