"""Tiered KV caching for lmstack: prefix reuse in device memory plus a disk tier."""

from lmstack_tiered_cache.cache import TieredCache, TieredCacheOptions
from lmstack_tiered_cache.store import DiskStore

__all__ = ["DiskStore", "TieredCache", "TieredCacheOptions"]
