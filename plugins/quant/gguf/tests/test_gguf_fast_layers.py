"""The decoder's fast path over lmstack-gguf's layers (`GGUFLinear.fast_op`: the bound kernel,
one call for a fused layer of several segments; gate_up's silu * up and down's residual add in
their kernels where `fast_swiglu_op` / `fast_add_op` offer them) computes what the generic path
computes: a tiny Llama 3 as Q4_K_M (q / k Q4_K, v Q6_K: two segments in every qkv), greedy tokens and every
log-probability compared bit for bit with the fast layers and the per-step attention call off."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstack.engine.llm import LLM
from lmstack.sampling_params import SamplingParams
from lmstack.stack.plugins import make_plugin_manager
from lmstack.testing.gguf_writer import write_gguf
from lmstack.testing.kit import one_thread, tiny_stack
from lmstack_gguf.kernel import native_kernel
from lmstack_gguf.linear import GGUFLinear

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native_kernel() is None, reason="the kernels did not build")

PROMPTS = [list(range(3, 43)), [9, 4, 11], list(range(50, 62))]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    from lmstack.testing.tiny_families import write_tiny_family

    root = tmp_path_factory.mktemp("fast-layers")
    path = root / "llama3.q4_k_m.gguf"
    write_gguf(write_tiny_family("llama3", root / "llama3"), path, tensor_type="q4_k_m")
    return path


def _generate(llm) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with one_thread():
        outs = llm.generate(PROMPTS, params)
    return [
        (
            out.outputs[0].token_ids,
            [out.prompt_logprobs[i][p[i]] for i in range(1, len(p))]
            + [lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
        )
        for p, out in zip(PROMPTS, outs)
    ]


@pytest.mark.parametrize("quant", [{"weights": "gguf"}, {"weights": "gguf", "kquant_batches": "int8"}])
def test_fast_layers_over_gguf_segments_are_the_generic_path(q4_k_m, quant, monkeypatch) -> None:
    llm = LLM(
        {**tiny_stack(q4_k_m, max_model_len=64), "quant": {**quant, "kv_cache": "none"}},
        plugin_manager=make_plugin_manager(),
    )
    try:
        runner = llm.engine.executor.runner
        model = runner.model
        assert model._fast_layers is not None
        qkv = model.layers[0].qkv_proj
        assert isinstance(qkv, GGUFLinear) and len(qkv.segments) == 2
        # The fast path calls the linear's bound kernel where it has one (the panel kernels'
        # segments op, or the kq kernel), else the linear's forward.
        if qkv._fast is not None:
            assert qkv.fast_op()[1] == qkv._fast[2]
        # With AVX-512 VNNI the gate_up kernel applies silu * up itself (`fast_swiglu_op`; its
        # Q4_K halves are in panels) and the down kernel (Q6_K panels) adds into the residual
        # stream (`fast_add_op`): compared with the generic path's separate calls below.
        avx512 = native_kernel().best_isa() >= 2
        assert (model.layers[0].gate_up_proj.fast_swiglu_op() is not None) == avx512
        assert (model.layers[0].down_proj.fast_add_op() is not None) == avx512
        fast = _generate(llm)
        model._fast_layers = None
        monkeypatch.setattr(
            type(runner.decode_backend), "bind_decode", lambda self, meta: None, raising=False
        )
        generic = _generate(llm)
    finally:
        llm.engine.shutdown()
    assert fast == generic
