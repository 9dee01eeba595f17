"""`none`: no KV reuse across requests. The allocator is built without a block cache, so full
blocks are not even hashed; every prompt is computed from its first token."""

from __future__ import annotations

from lmstack.interfaces import BlockCache, BuildContext
from lmstack.registry import Component


class NoCache(BlockCache):
    reuses_blocks = False

    def lookup(self, block_hash: int) -> int | None:
        return None

    def register(self, block_hash: int, block_id: int) -> None:
        pass

    def evict(self, block_hash: int, block_id: int) -> None:
        pass


def build(options: object, ctx: BuildContext) -> NoCache:
    return NoCache()


COMPONENT = Component(
    name="none",
    kind="cache",
    factory=build,
    description="No KV reuse across requests.",
    capabilities={"devices": ("cpu", "cuda", "mps"), "tiers": ("device",), "persistent": False},
)
