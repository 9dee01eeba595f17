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
    capabilities={"devices": ("cpu", "cuda", "mps"), "tiers": ("device",), "persistent": False},
    requires={"allocator.content_hash": True},
)


@hookimpl
def lmstack_register_caches(register):
    register(COMPONENT)
