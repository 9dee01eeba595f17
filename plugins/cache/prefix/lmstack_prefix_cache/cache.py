"""`prefix`: device-memory prefix reuse.

The allocator hashes every full block (parent hash, token ids, the model fingerprint, the
request's cache salt and tenant) and asks this cache for the longest run of known blocks when a
request arrives; those blocks are shared (reference-counted) and their tokens skipped. Blocks
nobody uses stay in the allocator's free list in LRU order and remain reusable until a new
allocation takes them (then `evict` forgets them).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.content_hash import request_key
from lmstack.interfaces import BlockCache
from lmstack.sequence import Request


class PrefixCacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    # False: each tenant (from the API key) has its own blocks, as if salted. True: tenants with
    # the same prompt share blocks (faster, but one tenant can tell from time to first token that
    # another sent the same prefix). A request's own cache_salt always separates.
    share_across_tenants: Annotated[
        bool,
        msgspec.Meta(description="tenants with the same prompt share blocks (faster; leaks prefix timing)"),
    ] = False


class PrefixCache(BlockCache):
    def __init__(self, options: PrefixCacheOptions | None = None) -> None:
        self.options = options or PrefixCacheOptions()
        self._blocks: dict[int, int] = {}  # content hash -> device block holding it

    def request_key(self, request: Request) -> bytes:
        tenant = None if self.options.share_across_tenants else getattr(request, "tenant", None)
        return request_key(request.cache_salt, tenant)

    def lookup(self, block_hash: int) -> int | None:
        return self._blocks.get(block_hash)

    def register(self, block_hash: int, block_id: int) -> None:
        self._blocks[block_hash] = block_id

    def evict(self, block_hash: int, block_id: int) -> None:
        # Two sequences may have computed the same content into two blocks; the newer one is
        # registered, and the older one leaving must not forget it.
        if self._blocks.get(block_hash) == block_id:
            del self._blocks[block_hash]

    def __len__(self) -> int:
        return len(self._blocks)
