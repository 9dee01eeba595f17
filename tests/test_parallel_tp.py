"""Acceptance for the `tp` plugin: SmolLM2-135M in fp32 split over 3 ranks (3 query heads and 1
KV head each, a third of the MLP and of the 49152-token vocabulary) gives the single-process
engine's greedy tokens on the oracle prompts, under the oracle's stack (chunked prefill in
64-token chunks, continuous batching). The single-process engine is the one test_oracle.py
checks against transformers (shared for the session, so it loads once)."""

from __future__ import annotations

import pytest
from test_oracle import QUESTIONS, RAW, _stack

from lmstack import SamplingParams
from lmstack.engine.llm import LLM
from lmstack.testing.kit import one_thread

pytest.importorskip("lmstack_tp")

MAX_NEW = 12  # fewer than the oracle's 20: three ranks on two cores are slow


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    with one_thread():  # the engine process; each rank sets its own threads
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_smollm2_tp3_greedy_tokens_equal_single_process(shared_llm):
    single = shared_llm(_stack())
    tok = single.tokenizer
    prompts = [tok.encode(t) for t in RAW]
    prompts += [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    theirs = _greedy(single, prompts)
    tp = LLM({**_stack(), "parallel": {"name": "tp", "tp": 3}})
    try:
        assert tp.engine.executor.world_size == 3
        ours = _greedy(tp, prompts)
    finally:
        tp.engine.shutdown()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"prompt {i}: tp=3 gave {a}, one process {b}"
