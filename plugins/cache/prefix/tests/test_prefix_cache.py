"""The `prefix` cache with the reference allocator, driven without a model (fast)."""

from __future__ import annotations

from lmstack.components.paged import PagedAllocator
from lmstack.content_hash import CacheGeometry
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request, Sequence
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack_prefix_cache import PrefixCache, PrefixCacheOptions

BS = 4
GEOMETRY = CacheGeometry("m", "c", "float32", "none", 2, 1, 4, "float32", BS)


def cache(**options) -> PrefixCache:
    c = PrefixCache(PrefixCacheOptions(**options))
    c.bind(GEOMETRY)
    return c


_next = iter(range(10**6))


def seq(prompt: list[int], *, salt: str | None = None, tenant: str | None = None, **params) -> Sequence:
    sid = next(_next)
    req = Request(f"r{sid}", list(prompt), SamplingParams(max_tokens=4, temperature=0.0, **params))
    req.cache_salt = salt
    if tenant is not None:
        req.tenant = tenant  # what the API sets from the caller's key
    s = Sequence(sid, req, list(prompt))
    req.seqs.append(s)
    return s


def compute(alloc: PagedAllocator, s: Sequence) -> int:
    """Admit like the scheduler does and 'compute' the whole prompt; returns the cached tokens."""
    cached = s.num_computed_tokens = alloc.attach_cached_prefix(s)
    alloc.allocate(s, s.num_tokens - cached)
    s.num_computed_tokens = s.num_tokens
    return cached


PROMPT = list(range(100, 114))  # 3 full blocks + 2 tokens


def test_the_component_is_registered():
    registry = build_registry(make_plugin_manager())
    c = registry.get("cache", "prefix")
    assert c.distribution == "lmstack-prefix-cache"
    assert c.requires == {"allocator.content_hash": True}


def test_a_repeated_prompt_reuses_its_full_blocks_and_computes_the_last_token():
    alloc = PagedAllocator(16, BS, cache())
    a = seq(PROMPT)
    assert compute(alloc, a) == 0
    alloc.free(a)
    b = seq(PROMPT)
    assert compute(alloc, b) == 12
    # A prompt that is exactly 3 full blocks still computes its last token (its logits).
    alloc.free(b)
    c = seq(PROMPT[:12])
    assert compute(alloc, c) == 8


def test_sharing_a_live_prefix_counts_references():
    alloc = PagedAllocator(16, BS, cache())
    a = seq(PROMPT)
    compute(alloc, a)
    b = seq(PROMPT[:8] + [1, 2, 3, 4, 5])
    assert compute(alloc, b) == 8
    shared = alloc.block_table(a)[:2]
    assert alloc.block_table(b)[:2] == shared
    assert all(alloc.refcount(x) == 2 for x in shared)
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free_blocks() == 16


def test_salts_and_tenants_isolate():
    alloc = PagedAllocator(32, BS, cache())
    compute(alloc, seq(PROMPT, salt="a"))
    assert compute(alloc, seq(PROMPT, salt="b")) == 0
    assert compute(alloc, seq(PROMPT)) == 0
    assert compute(alloc, seq(PROMPT, salt="a")) == 12
    compute(alloc, seq(PROMPT, tenant="t1"))
    assert compute(alloc, seq(PROMPT, tenant="t2")) == 0
    assert compute(alloc, seq(PROMPT, tenant="t1")) == 12


def test_an_operator_may_share_across_tenants_but_salts_still_separate():
    alloc = PagedAllocator(32, BS, cache(share_across_tenants=True))
    compute(alloc, seq(PROMPT, tenant="t1"))
    assert compute(alloc, seq(PROMPT, tenant="t2")) == 12
    assert compute(alloc, seq(PROMPT, tenant="t2", salt="x")) == 0


def test_prompt_logprobs_requests_recompute_the_whole_prompt():
    alloc = PagedAllocator(16, BS, cache())
    compute(alloc, seq(PROMPT))
    assert compute(alloc, seq(PROMPT, prompt_logprobs=1)) == 0


def test_free_cached_blocks_are_evicted_least_recently_used_first():
    pc = cache()
    alloc = PagedAllocator(8, BS, pc)
    old, new = seq(list(range(9))), seq(list(range(50, 59)))  # 2 full blocks + 1 token each
    compute(alloc, old)
    alloc.free(old)
    compute(alloc, new)
    alloc.free(new)
    # A third prompt takes 5 blocks: the never-used ones, then the older prefix's.
    filler = seq(list(range(200, 220)))
    compute(alloc, filler)
    again = seq(list(range(50, 59)))
    assert compute(alloc, again) == 8, "the newer prefix survived"
    alloc.free(again)
    assert compute(alloc, seq(list(range(9)))) == 0, "the older prefix was evicted first"
    assert len(pc) <= 8


def test_evict_forgets_only_the_block_it_names():
    pc = cache()
    pc.register(7, 1)
    pc.register(7, 2)  # the same content computed again into block 2
    pc.evict(7, 1)
    assert pc.lookup(7) == 2
    pc.evict(7, 2)
    assert pc.lookup(7) is None


def test_a_miss_does_not_evict_a_cached_block():
    pc = cache()
    alloc = PagedAllocator(3, BS, pc)
    a = seq(list(range(12)))  # 3 full blocks: the whole pool, all cached once freed
    compute(alloc, a)
    alloc.free(a)
    assert len(pc) == 3
    # A prompt sharing nothing: looking it up must not take (and so evict) a free cached block.
    assert alloc.attach_cached_prefix(seq(list(range(500, 505)))) == 0
    assert len(pc) == 3


def test_blocks_filled_by_unverified_drafts_are_not_hashed():
    pc = cache()
    alloc = PagedAllocator(8, BS, pc)
    s = seq(list(range(9)))  # prompt computed: 2 full blocks hashed
    compute(alloc, s)
    assert len(pc) == 2
    # A decode step verifying 4 drafts writes slots 9..13; the tokens there are not known yet,
    # so block 2 (slots 8..11) must wait for them to be accepted before it gets a hash.
    s.num_computed_tokens = 8
    s.token_ids.append(77)
    s.draft_token_ids = [1, 2, 3, 4]
    alloc.allocate(s, 1 + 4)
    assert len(pc) == 2
    s.token_ids += [1, 2]  # two drafts accepted: block 2 is full with known tokens
    s.num_computed_tokens = 12
    alloc.truncate(s, 12)
    alloc.allocate(s, 0)
    assert len(pc) == 3
