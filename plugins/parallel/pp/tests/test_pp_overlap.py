"""Micro-batches in flight: with three micro-batches per step over two stages and prompts
prefilled in chunks, greedy tokens are the single-process engine's, and the stages overlap — stage 0 starts micro-batch m + 1 before
stage 1 has finished micro-batch m (an ordering of events, read from the ranks' trace)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from lmstack_pp.stage import TRACE_ENV

from lmstack.engine.llm import LLM
from lmstack.testing.kit import KIT_PROMPTS, greedy, reference_llm, tiny_stack


@pytest.mark.slow
def test_three_micro_batches_match_single_process_and_stages_overlap(tiny_model_path, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))  # spawned workers inherit it
    # A 16-token budget prefills the longer prompts in chunks: some micro-batches then have no
    # logits rows (a chunk that samples nothing), and nothing of theirs travels back.
    scheduler = {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 16}
    parallel = {"name": "pp", "pp": 2, "micro_batches": 3}
    llm = LLM(tiny_stack(tiny_model_path, scheduler=scheduler, parallel=parallel))
    try:
        ours = greedy(llm, list(KIT_PROMPTS), 8)
    finally:
        llm.engine.shutdown()
    theirs = greedy(reference_llm(tiny_stack(tiny_model_path)), list(KIT_PROMPTS), 8)
    assert [o.token_ids for o in ours] == [t.token_ids for t in theirs]

    spans: dict[tuple[int, int], dict[int, tuple[float, float]]] = defaultdict(dict)
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        spans[(r["step"], r["mb"])][r["stage"]] = (r["start"], r["end"])
    steps = {step for step, _ in spans}
    assert all((s, 0) in spans and len(spans[(s, 0)]) == 2 for s in steps), "every stage ran every step"
    # The decode steps of four sequences come in three micro-batches.
    overlapped = [
        (step, mb)
        for (step, mb), stages in spans.items()
        if (step, mb + 1) in spans and spans[(step, mb + 1)][0][0] < stages[1][1]
    ]
    multi = [(step, mb) for (step, mb) in spans if (step, mb + 1) in spans]
    assert len(multi) >= 8, f"expected steps split into micro-batches, got {sorted(spans)}"
    # A stage 0 that waited for stage 1 would overlap nowhere; one that does not can still lose
    # the processor between two micro-batches on a busy machine, so most (not all) must overlap.
    assert 2 * len(overlapped) >= len(multi), (
        f"stage 0 waited for stage 1 before its next micro-batch at {sorted(set(multi) - set(overlapped))}"
    )
