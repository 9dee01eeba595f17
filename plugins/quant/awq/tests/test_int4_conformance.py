"""The conformance kit for `rtn-int4` and `awq`, and the two read / write paths agreeing on
whole models (the tiny model quantized at load vs written as an int4 checkpoint and read back)."""

from __future__ import annotations

import pytest
import torch

from lmstack.sampling_params import SamplingParams
from lmstack.testing import QuantizerConformance
from lmstack.testing.kit import KIT_PROMPTS, generate, tiny_stack
from lmstack_awq.plugin import AWQ, RTN_INT4


class TestRtnInt4Conformance(QuantizerConformance):
    component = RTN_INT4
    reader = AWQ  # what serves the checkpoints rtn-int4 writes
    tensor_parallel = True
    dtypes = (torch.float32, torch.bfloat16)
    # int4 in groups of 128 of Gaussian weights: ~10 % relative error per layer output.
    quantization_error = 0.15
    # On the CPU a few fp32 rows go through the int4 op in bf16 (lmstack_awq.kernels.cpu_int4pack).
    activation_dtypes = {torch.float32: torch.bfloat16}


class TestRtnInt4SymmetricConformance(QuantizerConformance):
    component = RTN_INT4
    options = {"group_size": 32, "symmetric": True, "lm_head": "int8"}
    reader = AWQ
    tensor_parallel = True
    dtypes = (torch.float32,)
    quantization_error = 0.15
    # On the CPU a few fp32 rows go through the int4 op in bf16 (lmstack_awq.kernels.cpu_int4pack).
    activation_dtypes = {torch.float32: torch.bfloat16}


def _logprobs(stack):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    llm = LLM(stack, plugin_manager=make_plugin_manager())
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    outs = generate(llm, list(KIT_PROMPTS), sp)
    llm.engine.shutdown()
    return [(o.prompt_logprobs[1:], o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", ["ct", "autoawq"])
def test_awq_serves_what_rtn_int4_computes(int4_models, tiny_model_path, kind):
    """awq on the written checkpoint == rtn-int4 quantizing the dense one at load."""
    rtn = _logprobs(tiny_stack(tiny_model_path, quant={"weights": "rtn-int4"}))
    awq = _logprobs(tiny_stack(int4_models[kind], quant={"weights": "awq"}))
    for (lp_a, tok_a), (lp_b, tok_b) in zip(rtn, awq, strict=True):
        assert tok_a == tok_b
        for a, b in zip(lp_a, lp_b, strict=True):
            ((ka, va),) = a.items()
            assert abs(va - b[ka]) < 1e-4
