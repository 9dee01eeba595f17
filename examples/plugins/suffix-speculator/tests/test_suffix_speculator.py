"""The example speculator plugin `suffix`: the core's speculator conformance kit on the registered
component, what it drafts, and greedy generation on the tiny random-weight model identical to
plain decoding while drafts are proposed and verified.

    pip install -e examples/plugins/suffix-speculator && python -m pytest examples/plugins/suffix-speculator/tests
"""

from __future__ import annotations

import pytest

from lmstack import LLM, SamplingParams
from lmstack.errors import ConfigError
from lmstack.stack.config import load_stack
from lmstack.stack.plugins import default_registry
from lmstack.stack.resolve import resolve
from lmstack.testing import SpeculatorConformance
from lmstack_suffix_speculator import SuffixOptions, SuffixSpeculator

pytest_plugins = ["lmstack.testing.fixtures"]


class TestSuffixConformance(SpeculatorConformance):
    component = "suffix"
    options = {"num_draft_tokens": 3}


def drafter(**options) -> SuffixSpeculator:
    return SuffixSpeculator(SuffixOptions(**options))


@pytest.mark.parametrize(
    ("tokens", "options", "expected"),
    [
        # The suffix (7, 8) occurred twice: the latest occurrence wins.
        ([7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8], {}, [3, 4, 5, 7]),
        # At most num_draft_tokens tokens.
        ([7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8], {"num_draft_tokens": 2}, [3, 4]),
        # A longer match beats a more recent shorter one: (1, 2, 3) predicts 9, (3) alone 5.
        ([1, 2, 3, 9, 9, 3, 5, 1, 2, 3], {}, [9, 9, 3, 5]),
        # min_ngram 2: the single token 3 is not looked up.
        ([3, 5, 6, 3], {"min_ngram": 2}, []),
        ([3, 5, 6, 3], {}, [5, 6, 3]),
        # Drafts run up to the end of the sequence (a repeating run predicts itself).
        ([4, 4, 4, 4], {"max_ngram": 2}, [4]),
        # Nothing occurred before.
        ([1, 2, 3, 4], {}, []),
        ([1], {}, []),
    ],
)
def test_drafts(tokens, options, expected):
    assert drafter(**options).draft(tokens) == expected


def test_options_are_checked_with_their_path():
    stack = load_stack({"speculator": {"name": "suffix", "min_ngram": 3, "max_ngram": 2}})
    with pytest.raises(ConfigError, match=r"speculator\.max_ngram: must be >= min_ngram \(3\), got 2"):
        resolve(stack, default_registry())


STACK = {
    "dtype": "float32",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 256},
    "allocator": {"name": "paged", "block_size": 4, "kv_cache_memory": "16MiB"},
}


def _generate(model_path, speculator: dict):
    llm = LLM({**STACK, "model": str(model_path), "speculator": speculator})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Repetitive prompts, so that their suffixes occur earlier and drafts are proposed.
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]
    outputs = llm.generate(prompts, params)
    return [out.outputs[0].token_ids for out in outputs], llm.get_stats()


def test_greedy_output_is_plain_decoding(tiny_model_path):
    plain, _ = _generate(tiny_model_path, {"name": "none"})
    drafted, stats = _generate(tiny_model_path, {"name": "suffix", "num_draft_tokens": 3})
    assert drafted == plain
    assert [len(tokens) for tokens in drafted] == [16, 16]
    assert stats.num_draft_tokens > 0  # drafts were proposed and verified, not skipped
