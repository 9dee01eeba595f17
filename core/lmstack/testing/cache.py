"""Cache conformance: a cache (kind ``cache``) must never change what the model outputs.

Subclass `CacheConformance` with the registered name of your cache (or its `Component`) and,
optionally, its options; a cache that needs a directory overrides `cache_options`::

    from lmstack.testing import CacheConformance

    class TestMyCache(CacheConformance):
        component = "my-cache"
        options = {"capacity": 64}

The kit runs the tiny test model (fp32) with your cache and compares greedy outputs with the same
stack built from the reference components: repeated prompts and a shared system prompt, chunked
prefill, a tiny KV pool that forces preemption and eviction, ``n > 1``, prompt logprobs over a
cached prefix, and isolation by cache salt. A cache whose entries outlive the process
(capability ``persistent``) also overrides `corrupt_entries`, and the kit checks that damaged
entries are misses, never wrong tokens, and that a second engine finds the first one's entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from lmstack.sampling_params import SamplingParams
from lmstack.testing.components import build_component, lookup
from lmstack.testing.kit import ComponentKit, one_thread, plugin_manager_for, reference_llm, tiny_stack

BLOCK_SIZE = 16
# Byte-level tokens on the tiny model: the shared system prompt spans several full blocks.
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, politely. "
    "The bakery opens at seven and sells bread, cakes and coffee. "
)
QUESTIONS = ("When do you open?", "Do you sell coffee?", "What can I buy here?")
MAX_TOKENS = 6


def greedy(max_tokens: int = MAX_TOKENS, **params: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class CacheConformance(ComponentKit):
    kind: ClassVar[str] = "cache"

    # --- what a subclass may override ----------------------------------------------------------

    @classmethod
    def cache_options(cls, tmp_dir: Path) -> dict[str, Any]:
        """The cache's options; `tmp_dir` is a fresh directory for this class (a disk tier's)."""
        return dict(cls.options)

    def corrupt_entries(self, options: dict[str, Any]) -> int:
        """Damage every stored entry (flip bytes, truncate, ...) and return how many; only
        called for caches declaring ``persistent``."""
        raise NotImplementedError("a persistent cache's kit subclass must say how to damage its entries")

    # --- plumbing ------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def cache_options_here(cls, tmp_path_factory) -> dict[str, Any]:
        return cls.cache_options(tmp_path_factory.mktemp("cache"))

    @classmethod
    def make_llm(cls, model_path, options: dict[str, Any], **sections: Any):
        from lmstack.engine.llm import LLM

        pm, name = plugin_manager_for(lookup(cls.component, cls.kind))
        stack = tiny_stack(model_path, **sections)
        stack["cache"] = {"name": name, **options}
        return LLM(stack, plugin_manager=pm)

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, tiny_model_path, cache_options_here):
        llm = cls.make_llm(tiny_model_path, cache_options_here)
        yield llm
        llm.engine.shutdown()

    @staticmethod
    def run(llm, prompts, params, **kw):
        with one_thread():
            return llm.generate(list(prompts), params, **kw)

    def baseline(self, model_path, prompts, params, **sections):
        return tokens(self.run(reference_llm(tiny_stack(model_path, **sections)), prompts, params))

    prompts = [SYSTEM + q for q in QUESTIONS]

    # --- the checks --------------------------------------------------------------------------

    def test_registered_component_builds(self, cache_options_here) -> None:
        comp = self.registered()
        assert comp.kind == "cache"
        build_component(comp, "cache", cache_options_here)

    def test_repeated_prompts_hit_and_match(self, llm, tiny_model_path):
        want = self.baseline(tiny_model_path, self.prompts[:2], greedy())
        for i, p in enumerate(self.prompts[:2]):
            first, again = self.run(llm, [p], greedy())[0], self.run(llm, [p], greedy())[0]
            assert tokens([first]) == tokens([again]) == [want[i]]
            assert again.num_cached_tokens >= BLOCK_SIZE, "a repeated prompt reuses its full blocks"
            assert again.num_cached_tokens % BLOCK_SIZE == 0
            assert again.num_cached_tokens < len(again.prompt_token_ids), "the last token is computed"

    def test_a_batch_sharing_a_system_prompt_matches_with_chunked_prefill(self, llm, tiny_model_path):
        # A 32-token budget cuts every prompt into chunks; later requests start their prefill
        # at the cached boundary while earlier ones still run.
        chunked = {"scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 32}}
        want = self.baseline(tiny_model_path, self.prompts, greedy(), **chunked)
        other = self.make_llm(tiny_model_path, self._options(llm), **chunked)
        try:
            assert tokens(self.run(other, self.prompts, greedy())) == want
            assert tokens(self.run(other, self.prompts, greedy())) == want
        finally:
            other.engine.shutdown()

    def test_n_samples_share_and_match(self, llm, tiny_model_path):
        params = greedy(n=2)
        want = self.baseline(tiny_model_path, self.prompts[:2], params)
        assert tokens(self.run(llm, self.prompts[:2], params)) == want
        assert tokens(self.run(llm, self.prompts[:2], params)) == want

    def test_prompt_logprobs_over_a_cached_prefix_are_complete(self, llm, tiny_model_path):
        params = greedy(2, prompt_logprobs=0)
        self.run(llm, self.prompts[:1], greedy())  # the prefix is cached now
        (want,) = self.run(reference_llm(tiny_stack(tiny_model_path)), self.prompts[:1], params)
        (got,) = self.run(llm, self.prompts[:1], params)
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.prompt_logprobs[0] is None and all(e for e in got.prompt_logprobs[1:])
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)

    def test_isolation_by_salt(self, llm):
        p = self.prompts[1:2]
        self.run(llm, p, greedy(), cache_salt="tenant-a")
        (same,) = self.run(llm, p, greedy(), cache_salt="tenant-a")
        (other,) = self.run(llm, p, greedy(), cache_salt="tenant-b")
        assert same.num_cached_tokens > 0
        assert other.num_cached_tokens == 0, "a request with another salt got a hit"
        assert tokens([same]) == tokens([other])

    def test_a_tiny_pool_preempts_evicts_and_still_matches(self, llm, tiny_model_path):
        # A pool one block short of what the three prompts need at their shortest final length,
        # even sharing the system prompt's blocks: sequences are preempted, cached blocks evicted.
        params = greedy(4 * MAX_TOKENS)
        ids = [llm.tokenizer.encode(p) for p in self.prompts]
        common = min(len(x) for x in ids)
        while any(x[:common] != ids[0][:common] for x in ids):
            common -= 1
        shared = common // BLOCK_SIZE
        per_seq = -(-(min(len(x) for x in ids) + params.max_tokens) // BLOCK_SIZE)
        blocks = shared + 3 * (per_seq - shared) - 1
        pool = {"allocator": {"name": "paged", "block_size": BLOCK_SIZE, "num_blocks": blocks}}
        want = self.baseline(tiny_model_path, self.prompts, params)
        tight = self.make_llm(tiny_model_path, self._options(llm), **pool)
        try:
            assert tokens(self.run(tight, self.prompts, params)) == want
            assert tokens(self.run(tight, self.prompts[::-1], params)) == want[::-1]
            eng = tight.engine
            assert eng.get_stats().num_preemptions > 0, "the pool was meant to force preemption"
            assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks, "blocks leaked"
        finally:
            tight.engine.shutdown()

    def test_a_second_engine_finds_persistent_entries(self, llm, tiny_model_path):
        if not self.registered().capabilities.get("persistent"):
            pytest.skip("the cache keeps no entries outside the process")
        p = ["Restart check. " + SYSTEM]
        (first,) = self.run(llm, p, greedy())
        llm.engine.cache.close()  # pending writes land
        fresh = self.make_llm(tiny_model_path, self._options(llm))
        try:
            (again,) = self.run(fresh, p, greedy())
            assert again.num_cached_tokens >= BLOCK_SIZE
            assert tokens([again]) == tokens([first])
        finally:
            fresh.engine.shutdown()

    def test_corrupt_entries_are_misses_not_wrong_tokens(self, llm, tiny_model_path):
        if not self.registered().capabilities.get("persistent"):
            pytest.skip("the cache keeps no entries outside the process")
        want = self.baseline(tiny_model_path, self.prompts, greedy())
        self.run(llm, self.prompts, greedy())
        llm.engine.cache.close()
        assert self.corrupt_entries(self._options(llm)) > 0, "nothing was stored to damage"
        fresh = self.make_llm(tiny_model_path, self._options(llm))
        try:
            assert tokens(self.run(fresh, self.prompts, greedy())) == want
        finally:
            fresh.engine.shutdown()

    @staticmethod
    def _options(llm) -> dict[str, Any]:
        return {k: v for k, v in llm.engine.stack.config.cache.items() if k != "name"}
