"""Cache conformance: a cache (kind ``cache``) must never change what the model outputs.

Subclass `CacheConformance` with the registered name of your cache (or its `Component`) and,
optionally, its options::

    from lmstack.testing import CacheConformance

    class TestMyCache(CacheConformance):
        component = "my-cache"
        options = {"capacity": 64}

The kit runs SmolLM2-135M (fp32) with your cache and compares greedy outputs with the same
stack without a cache: repeated prompts and a shared system prompt, chunked prefill, a tiny KV
pool that forces preemption and eviction, ``n > 1``, prompt logprobs over a cached prefix, and
isolation by cache salt. A cache whose entries outlive the process (capability
``persistent``) also overrides `corrupt_entries`, and the kit checks that damaged entries are
misses, never wrong tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmstack.hookspecs import hookimpl
from lmstack.registry import Component
from lmstack.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, politely, and "
    "never invent prices. The bakery opens at seven, closes at six, and sells bread, cakes and "
    "coffee. "
)
QUESTIONS = ["When do you open?", "Do you sell coffee?", "What can I buy here?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)

# Outputs of the stack without a cache, per (model, what was asked): computed once a session and
# shared by every kit subclass.
_BASELINE: dict[str, list[Any]] = {}
_BASELINE_LLM: dict[str, Any] = {}


class _Offer:
    """Registers a `Component` object given to the kit instead of an installed name."""

    def __init__(self, component: Component) -> None:
        self.component = component

    @hookimpl
    def lmstack_register_caches(self, register):
        register(self.component)


class CacheConformance:
    component: str | Component = ""
    options: dict[str, Any] = {}
    model: str = MODEL

    # --- what a subclass may override ----------------------------------------------------------

    @classmethod
    def cache_options(cls, tmp_dir: Path) -> dict[str, Any]:
        """The cache's options; `tmp_dir` is a fresh directory for this class (a disk tier's)."""
        return dict(cls.options)

    def corrupt_entries(self, options: dict[str, Any]) -> int:
        """Damage every stored entry (flip bytes, truncate, ...) and return how many; only
        called for caches declaring ``persistent``."""
        raise NotImplementedError("a persistent cache's kit subclass must say how to damage its entries")

    # --- plumbing ----------------------------------------------------------------------------

    @staticmethod
    def _name_of(component: str | Component) -> str:
        return component.name if isinstance(component, Component) else component

    @classmethod
    def _plugin_manager(cls):
        from lmstack.plugins import make_plugin_manager

        if isinstance(cls.component, Component):
            return make_plugin_manager(extra_plugins=[_Offer(cls.component)])
        return make_plugin_manager()

    @classmethod
    def stack(cls, cache: dict[str, Any] | None, **over: Any) -> dict[str, Any]:
        stack: dict[str, Any] = {
            "model": cls.model,
            "dtype": "float32",
            "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 32},
            "allocator": {"name": "paged", "block_size": BLOCK_SIZE, "num_blocks": 256},
        }
        if cache is not None:
            stack["cache"] = cache
        stack.update(over)
        return stack

    @classmethod
    def make_llm(cls, cache: dict[str, Any] | None, **over: Any):
        from lmstack.errors import ConfigError
        from lmstack.llm import LLM
        from lmstack.model.source import resolve_model_path

        try:
            resolve_model_path(cls.model)
        except ConfigError as exc:
            pytest.skip(str(exc))
        return LLM(cls.stack(cache, **over), plugin_manager=cls._plugin_manager())

    def baseline(self, key: str, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
        full = json.dumps([self.model, key, prompts, repr(params)])
        if full not in _BASELINE:
            if self.model not in _BASELINE_LLM:
                _BASELINE_LLM[self.model] = self.make_llm(None)
            _BASELINE[full] = _BASELINE_LLM[self.model].generate(prompts, params)
        return _BASELINE[full]

    @pytest.fixture(scope="class")
    @classmethod
    def cache_dir(cls, tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp("cache")

    @pytest.fixture(scope="class")
    @classmethod
    def cache_section(cls, cache_dir) -> dict[str, Any]:
        return {"name": cls._name_of(cls.component), **cls.cache_options(cache_dir)}

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, cache_section):
        llm = cls.make_llm(cache_section)
        yield llm
        llm.engine.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls, llm) -> list[list[int]]:
        tok = llm.tokenizer
        return [
            tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS
        ]

    @staticmethod
    def tokens(outputs) -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs] for o in outputs]

    # --- the checks --------------------------------------------------------------------------

    def test_repeated_prompts_hit_and_match(self, llm, prompts):
        want = self.tokens(self.baseline("one", prompts, GREEDY))
        for i, p in enumerate(prompts[:2]):
            first, again = llm.generate(p, GREEDY)[0], llm.generate(p, GREEDY)[0]
            assert self.tokens([first]) == self.tokens([again]) == [want[i]]
            assert again.num_cached_tokens >= BLOCK_SIZE, "a repeated prompt reuses its full blocks"
            assert again.num_cached_tokens % BLOCK_SIZE == 0 and again.num_cached_tokens < len(p)

    def test_a_batch_sharing_a_system_prompt_matches_with_chunked_prefill(self, llm, prompts):
        # The scheduler's budget (32 tokens) cuts every prompt into chunks; later requests start
        # their prefill at the cached boundary while earlier ones still decode.
        want = self.baseline("batch", prompts, GREEDY)
        got = llm.generate(prompts, GREEDY)
        assert self.tokens(got) == self.tokens(want)

    def test_n_samples_share_and_match(self, llm, prompts):
        params = SamplingParams(temperature=0.0, max_tokens=6, n=2)
        want = self.baseline("n2", prompts[:2], params)
        assert self.tokens(llm.generate(prompts[:2], params)) == self.tokens(want)
        assert self.tokens(llm.generate(prompts[:2], params)) == self.tokens(want)

    def test_prompt_logprobs_over_a_cached_prefix_are_complete(self, llm, prompts):
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
        llm.generate(prompts[0], GREEDY)  # make sure the prefix is cached
        (want,) = self.baseline("plp", prompts[:1], params)
        (got,) = llm.generate(prompts[0], params)
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(prompts[0])
        assert got.prompt_logprobs[0] is None and all(e for e in got.prompt_logprobs[1:])
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a)

    def test_isolation_by_salt(self, llm, prompts):
        p = prompts[1]
        llm.generate(p, GREEDY, cache_salt="tenant-a")
        same = llm.generate(p, GREEDY, cache_salt="tenant-a")[0]
        other = llm.generate(p, GREEDY, cache_salt="tenant-b")[0]
        assert same.num_cached_tokens > 0
        assert other.num_cached_tokens == 0
        assert self.tokens([same]) == self.tokens([other])

    def test_a_tiny_pool_preempts_evicts_and_still_matches(self, cache_section, prompts):
        # 8 blocks of 16 tokens: three ~60-token prompts growing past 64 tokens cannot all run
        # even when they share their system prompt's blocks, so sequences are preempted and
        # cached blocks are evicted and recomputed.
        params = SamplingParams(temperature=0.0, max_tokens=8)
        want = self.tokens(self.baseline("tiny", prompts, params))
        llm = self.make_llm(
            cache_section, allocator={"name": "paged", "block_size": BLOCK_SIZE, "num_blocks": 8}
        )
        try:
            assert self.tokens(llm.generate(prompts, params)) == want
            assert self.tokens(llm.generate(prompts[::-1], params)) == want[::-1]
            eng = llm.engine
            assert eng.get_stats().num_preemptions > 0, "the pool was meant to force preemption"
            assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks, "blocks leaked"
        finally:
            llm.engine.shutdown()

    def test_corrupt_entries_are_misses_not_wrong_tokens(self, llm, cache_section, prompts):
        if not llm.engine.stack.cache.capabilities.get("persistent"):
            pytest.skip("the cache keeps no entries outside the process")
        want = self.tokens(self.baseline("one", prompts, GREEDY))
        llm.generate(prompts, GREEDY)
        llm.engine.cache.close()  # pending writes land before they are damaged
        options = {k: v for k, v in cache_section.items() if k != "name"}
        assert self.corrupt_entries(options) > 0, "nothing was stored to damage"
        fresh = self.make_llm(cache_section)
        try:
            assert self.tokens(fresh.generate(prompts, GREEDY)) == want
        finally:
            fresh.engine.shutdown()
