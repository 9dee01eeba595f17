"""Pipeline parallelism (`lmstack-pp`) on the real SmolLM2 in fp32: two stages (15 decoder
layers each, activations passed over gloo, two micro-batches per step) generate the same greedy
tokens as the single-process engine — which `test_oracle` holds to transformers — on the oracle
prompts, run together under continuous batching with chunked prefill."""

from __future__ import annotations

import pytest
from test_oracle import _run, _stack, prompts  # noqa: F401  (`prompts` is a fixture)

from lmstack.plugins import build_registry, make_plugin_manager


@pytest.mark.slow
def test_pp2_greedy_equals_single_process(shared_llm, prompts):  # noqa: F811
    if "pp" not in build_registry(make_plugin_manager()).names("parallel"):
        pytest.skip("the lmstack-pp plugin is not installed")
    single = _run(shared_llm(_stack()).engine, prompts)
    llm = shared_llm(_stack(parallel={"name": "pp", "pp": 2}))
    assert llm.engine.executor.world_size == 2
    assert _run(llm.engine, prompts) == single
