"""Prefix caching for lmstack: full KV blocks are reused across requests by content hash."""

from lmstack_prefix_cache.cache import PrefixCache, PrefixCacheOptions

__all__ = ["PrefixCache", "PrefixCacheOptions"]
