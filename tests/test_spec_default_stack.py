"""Speculative decoding on the default CPU stack (`examples/stacks/cpu.yaml`: the GGUF's blocks
multiplied with activations rounded to int8, cpu-paged attention, bf16 K/V) gives plain
decoding's greedy tokens exactly.

A verification computes several positions of a sequence in one call where plain decoding computes
one; the logits agree to the bit only because every kernel on the way computes a row the same
whatever rows share its call (cpu-paged's fixed key parts, lmstack-gguf's block kernels up to
the panels threshold). With int8 activations the smallest difference is amplified: before
cpu-paged's rows were batch-invariant, these prompts diverged from plain decoding within 10-30
tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STACK = ROOT / "examples" / "stacks" / "cpu.yaml"


def input_grounded_prompts() -> list[str]:
    """Three of `benchmarks/speculative.py`'s prompts (code edits that quote the prompt): the ones
    seen diverging first."""
    spec = importlib.util.spec_from_file_location("speculative_bench", ROOT / "benchmarks" / "speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    texts = bench.prompts()
    return [texts[5], texts[4], texts[0]]


def test_ngram_verification_reproduces_plain_decoding_on_the_default_cpu_stack(smollm2_path):
    pytest.importorskip("lmstack_ngram")
    from lmstack import LLM, SamplingParams

    stack = yaml.safe_load(STACK.read_text())
    assert stack["quant"]["activations"] == "int8", "the case this test is about"
    stack.pop("server", None)
    stack["scheduler"]["max_num_seqs"] = 1
    plain = LLM({**stack, "speculator": {"name": "none"}})
    # Always 4 drafts (5 rows per verification: lmstack-gguf's block kernels, below its panels).
    drafted = LLM({**stack, "speculator": {"name": "ngram", "adaptive": False, "num_draft_tokens": 4}})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        for text in input_grounded_prompts():
            ids = plain.tokenizer.encode_chat([{"role": "user", "content": text}])
            want = plain.generate([ids], params)[0].token_ids
            got = drafted.generate([ids], params)[0].token_ids
            assert list(got) == list(want), text[:60]
        stats = drafted.get_stats()
        assert stats.num_accepted_tokens > 0, "no draft was accepted: the test checked nothing"
    finally:
        plain.engine.shutdown()
        drafted.engine.shutdown()
