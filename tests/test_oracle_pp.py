"""Pipeline parallelism (`lmstack-pp`) on the real SmolLM2 in fp32: two stages (15 decoder
layers each, activations passed over gloo, two micro-batches per step) generate the same greedy
tokens as the single-process engine — which `test_oracle` holds to transformers — on the oracle
prompts, run together under continuous batching with chunked prefill (64-token budget: some
micro-batches are prompt chunks without logits rows)."""

from __future__ import annotations

import pytest
from test_oracle import _stack, prompts  # noqa: F401  (`prompts` is a fixture)

from lmstack import SamplingParams
from lmstack.engine.llm import LLM
from lmstack.engine.llm_engine import LLMEngine
from lmstack.stack.plugins import build_registry, make_plugin_manager

NEW_TOKENS = 10  # modest: the pipeline's share of the suite's time


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    results: dict[int, list[int]] = {}
    while len(results) < len(prompts):
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
    return [results[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_pp2_greedy_equals_single_process(shared_llm, prompts):  # noqa: F811
    if "pp" not in build_registry(make_plugin_manager()).names("parallel"):
        pytest.skip("the lmstack-pp plugin is not installed")
    single = _greedy(shared_llm(_stack()).engine, prompts)
    llm = shared_llm(_stack(parallel={"name": "pp", "pp": 2}))
    assert llm.engine.executor.world_size == 2
    assert _greedy(llm.engine, prompts) == single


@pytest.mark.slow
def test_tp3_x_pp2_greedy_equals_single_process(shared_llm, prompts):  # noqa: F811
    """Both splits at once: two stages of three tensor-parallel ranks each (six processes)."""
    if "pp" not in build_registry(make_plugin_manager()).names("parallel"):
        pytest.skip("the lmstack-pp plugin is not installed")
    single = _greedy(shared_llm(_stack()).engine, prompts)
    llm = LLM(_stack(parallel={"name": "pp", "pp": 2, "tp": 3}))
    try:
        assert llm.engine.executor.world_size == 6
        assert _greedy(llm.engine, prompts) == single
    finally:
        llm.engine.shutdown()
