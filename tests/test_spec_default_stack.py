"""Speculative decoding on the default CPU stack (`examples/stacks/cpu.yaml`: the GGUF's blocks
multiplied with activations rounded to int8, cpu-paged attention, bf16 K/V) gives plain
decoding's greedy tokens exactly.

A verification computes several positions of a sequence in one call where plain decoding computes
one; the logits agree to the bit only because every kernel on the way computes a row the same
whatever rows share its call (cpu-paged's fixed key parts; lmstack-gguf's panels, which every
decoder-layer batch takes, and the LM head's block kernel below 6 rows, or its panels for every
batch with AVX-512 VNNI). With int8 activations the smallest difference is amplified: before
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
    """Three of `benchmarks/e2e/speculative.py`'s prompts (code edits that quote the prompt): the ones
    seen diverging first."""
    spec = importlib.util.spec_from_file_location(
        "speculative_bench", ROOT / "benchmarks" / "e2e" / "speculative.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    texts = bench.prompts()
    return [texts[5], texts[4], texts[0]]


def test_ngram_verification_reproduces_plain_decoding_on_the_default_cpu_stack(smollm2_path):
    pytest.importorskip("lmstack_ngram")
    from lmstack import LLM, SamplingParams

    stack = yaml.safe_load(STACK.read_text())
    stack.pop("server", None)
    stack["scheduler"] = {**stack.get("scheduler", {}), "max_num_seqs": 1}
    plain = LLM({**stack, "speculator": {"name": "none"}})
    assert plain.engine.stack.quantizer.options.activations == "int8", "the case this test is about"
    # Always 4 drafts (5 rows per verification: below the LM head's panels on an AVX2-only CPU).
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


def every_row_is_batch_invariant() -> bool:
    """Whether the default stack computes every row of a step alike in any batch on this CPU: the
    decoder layers and the LM head on lmstack-gguf's panels for every batch (AVX-512 VNNI)."""
    try:
        from lmstack_gguf import quantizer
    except ImportError:
        return False
    return quantizer.panels_cpu() and quantizer.head_panels_min_rows() == 1


def test_any_draft_length_and_any_batch_reproduce_plain_decoding_where_every_row_is_invariant(smollm2_path):
    """Where every kernel of the step computes a row alike in any batch: 8 drafts (9-row
    verifications, past the head's 6-row crossover on AVX2) still give plain decoding's tokens,
    and a prompt decoded among 7 others gives the tokens it gets alone."""
    pytest.importorskip("lmstack_ngram")
    if not every_row_is_batch_invariant():
        pytest.skip("here the LM head keeps its block kernel below 6 rows (AVX2) or the panels do not run")
    from lmstack import LLM, SamplingParams

    stack = yaml.safe_load(STACK.read_text())
    stack.pop("server", None)
    # Steps of at most 128 rows: prefill chunks stay below the bf16 copy an AMX CPU takes from 256
    # rows (`prefill: panels+bf16`), which rounds otherwise than the panels.
    stack["scheduler"] = {**stack.get("scheduler", {}), "max_num_seqs": 8, "max_num_batched_tokens": 128}
    # Every prompt computed in the shared batch, not attached from the prefix cache (on by default).
    stack["cache"] = {"name": "none"}
    plain = LLM({**stack, "speculator": {"name": "none"}})
    drafted = LLM({**stack, "speculator": {"name": "ngram", "adaptive": False, "num_draft_tokens": 8}})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48)
        prompts = [
            plain.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in input_grounded_prompts()
        ]
        alone = [list(plain.generate([ids], params)[0].token_ids) for ids in prompts]
        for ids, want in zip(prompts, alone, strict=True):
            assert list(drafted.generate([ids], params)[0].token_ids) == want
        assert drafted.get_stats().num_accepted_tokens > 0, "no draft was accepted: the test checked nothing"
        others = [
            plain.tokenizer.encode_chat([{"role": "user", "content": f"Count to {n} in words."}])
            for n in range(5)
        ]
        together = plain.generate(prompts + others, params)
        assert [list(o.token_ids) for o in together[: len(prompts)]] == alone
    finally:
        plain.engine.shutdown()
        drafted.engine.shutdown()
