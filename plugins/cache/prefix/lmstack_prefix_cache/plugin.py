"""Registers the `prefix` cache."""

from __future__ import annotations

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.registry import Component
from lmstack_prefix_cache.cache import PrefixCache, PrefixCacheOptions


def build(options: PrefixCacheOptions, ctx: BuildContext) -> PrefixCache:
    return PrefixCache(options)


COMPONENT = Component(
    name="prefix",
    kind="cache",
    factory=build,
    options_type=PrefixCacheOptions,
    description="Prefix caching: full KV blocks reused across requests by content hash (LRU), per tenant.",
    # `cache: auto` (the default) takes it wherever it is installed, as vLLM turns prefix caching
    # on by default: a request sharing a prompt prefix (a system prompt, a chat's history) skips
    # computing it, and output is the same with or without it.
    capabilities={
        "devices": ("cpu", "cuda", "mps"),
        "tiers": ("device",),
        "persistent": False,
        "auto_rank": {"cpu": 10, "cuda": 10, "mps": 10},
    },
    requires={"allocator.content_hash": True},
)


@hookimpl
def lmstack_register_caches(register):
    register(COMPONENT)
