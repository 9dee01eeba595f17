"""Registers the `tiered` cache."""

from __future__ import annotations

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.registry import Component
from lmstack_tiered_cache.cache import TieredCache, TieredCacheOptions


def build(options: TieredCacheOptions, ctx: BuildContext) -> TieredCache:
    return TieredCache(options)


COMPONENT = Component(
    name="tiered",
    kind="cache",
    factory=build,
    options_type=TieredCacheOptions,
    description="Prefix caching plus a disk tier (checksummed block files, LRU capacity) that outlives the process.",
    capabilities={"devices": ("cpu", "cuda", "mps"), "tiers": ("device", "disk"), "persistent": True},
    requires={"allocator.content_hash": True},
)


@hookimpl
def lmstack_register_caches(register):
    register(COMPONENT)
