"""The `ngram` speculator: its index against a brute-force scan, the conformance kit, and greedy
output through the engine identical to plain decoding.

    python -m pytest plugins/speculative/ngram/tests
"""

from __future__ import annotations

import random

import pytest

from lmstack import LLM, SamplingParams
from lmstack.errors import ConfigError
from lmstack.stack.config import load_stack
from lmstack.stack.plugins import default_registry
from lmstack.stack.resolve import resolve
from lmstack.testing import SpeculatorConformance
from lmstack_ngram import NgramIndex

pytest_plugins = ["lmstack.testing.fixtures"]


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "expected"),
    [
        ([1, 2, 3, 9, 9, 3, 5, 1, 2, 3], 1, 3, [9, 9, 3, 5]),
        ([3, 5, 6, 3], 2, 3, []),  # the single token 3 is not looked up
        ([3, 5, 6, 3], 1, 3, [5, 6, 3]),
        ([4, 4, 4, 4], 1, 2, [4]),  # a repeating run predicts itself, up to the end
        ([1, 2, 3, 4], 1, 4, []),
        ([1], 1, 4, []),
        ([], 1, 4, []),
    ],
)
def test_drafts(tokens, min_n, max_n, expected):
    assert NgramIndex(min_n, max_n).draft(tokens, 4) == expected


def test_the_incremental_index_matches_a_full_scan_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(30):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        for _ in range(60):
            assert index.draft(tokens, k) == brute_force(tokens, min_n, max_n, k), (trial, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 4))]


def test_options_are_checked_with_their_path():
    stack = load_stack({"speculator": {"name": "ngram", "min_ngram": 3, "max_ngram": 2}})
    with pytest.raises(ConfigError, match=r"speculator\.max_ngram: must be >= min_ngram \(3\), got 2"):
        resolve(stack, default_registry())


class TestNgramConformance(SpeculatorConformance):
    component = "ngram"
    options = {"num_draft_tokens": 3}

    def test_greedy_tokens_identical_to_plain_decoding(self, tiny_model_path) -> None:
        super().test_greedy_tokens_identical_to_plain_decoding(tiny_model_path)
        # The kit's repetitive prompts give prompt lookup something to find.
        assert self.stats.num_draft_tokens > 0 and self.stats.num_accepted_tokens > 0


STACK = {
    "dtype": "float32",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 256},
    "allocator": {"name": "paged", "block_size": 4, "kv_cache_memory": "16MiB"},
}


def test_greedy_output_is_plain_decoding_while_sequences_come_and_go(tiny_model_path):
    """Repetitive prompts of different lengths, more requests than max_num_seqs (mid-run
    arrivals into a running batch), non-adaptive so that drafts are always verified."""
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11], [20, 21] * 9, list(range(30, 60)) * 2, [7] * 12]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = {}
    for name, spec in {"none": {"name": "none"}, "ngram": {"name": "ngram", "adaptive": False}}.items():
        llm = LLM({**STACK, "model": str(tiny_model_path), "speculator": spec})
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.get_stats()
        assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks
    assert outs["ngram"] == outs["none"]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
