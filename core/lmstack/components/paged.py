"""`paged`: the reference KV-cache block allocator (vLLM-style paging).

Fixed-size blocks, allocated as tokens arrive; per-sequence block tables; reference counts so
forks (n > 1) share the prompt's blocks, with copy-on-write when a shared block is written;
truncation for rejected drafts. Full blocks get a stable content hash (parent hash + token ids +
extra keys: the geometry's fingerprint, the request's salt and tenant) when a `BlockCache` is
attached: that is where prefix reuse and tiering plug in. Freed blocks keep their hash and stay
reusable in LRU order until a new allocation takes them.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Annotated, Literal

import msgspec
import torch

from lmstack.content_hash import block_hash
from lmstack.errors import ConfigError
from lmstack.interfaces import BlockCache, BuildContext, KVAllocator
from lmstack.kernels.hardware import kv_budget
from lmstack.registry import Component
from lmstack.sequence import Sequence

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


KV_MEMORY_AUTO = "auto"
BLOCK_SIZE_AUTO = "auto"
# `block_size: auto`: on a CPU a decode step reads each sequence's K/V block by block from places
# scattered over the cache, and the memory system streams a few long runs faster than many short
# ones: with 64-token blocks decode attention at 32 streams took ~17 % less time than with 16
# (SmolLM2's geometry, 2-core Zen 4), an in-process closed loop of 32 streams gave 1.11x the
# tokens a second (median of 4 alternated rounds); through the HTTP server the difference stayed
# within its run-to-run noise (~5 %). 128 gained ~3 % more but halves prefix-reuse granularity
# again. GPU kernels keep vLLM's 16.
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 64, 16


def auto_block_size(device: torch.device) -> tuple[int, str]:
    """`block_size: auto` on `device`: (tokens per block, why, for `lmstack check`)."""
    if device.type == "cpu":
        return CPU_BLOCK_SIZE, f"auto on cpu: {CPU_BLOCK_SIZE} (decode reads fewer, longer runs of K/V)"
    return GPU_BLOCK_SIZE, f"auto on {device.type}: {GPU_BLOCK_SIZE}"


def block_size_of(options: object, device: torch.device) -> int:
    """The tokens per block an allocator's options give on `device`: their `block_size` (`auto`
    resolved, as a resolved stack holds it already), 16 for options without one."""
    size = getattr(options, "block_size", GPU_BLOCK_SIZE)
    return auto_block_size(device)[0] if size == BLOCK_SIZE_AUTO else size


def parse_bytes(value: int | str, path: str = "allocator.kv_cache_memory") -> int:
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"expected a size like 512MiB or 2GiB, got {value!r}", path)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class PagedOptions(msgspec.Struct, forbid_unknown_fields=True):
    block_size: Annotated[
        int | Literal["auto"],
        msgspec.Meta(description="tokens per KV-cache block (1 to 1024); auto: 64 on a CPU, 16 on a GPU"),
    ] = BLOCK_SIZE_AUTO
    # Memory budget for K and V of all layers; the block count is derived from it. "auto" is
    # measured when the allocator is built, after the weights are loaded (`kv_budget`): on a GPU
    # 90% of its memory less what is in use (vLLM's gpu_memory_utilization); on a CPU 25% of the
    # available memory, at most 1 GiB (the cache is zero-filled up front: a laptop must not swap).
    kv_cache_memory: Annotated[
        int | str,
        msgspec.Meta(
            description='K/V memory of all layers ("2GiB"); auto: GPU 90% less use, CPU 25% of free, <=1GiB'
        ),
    ] = KV_MEMORY_AUTO
    # Overrides the budget (tests use it to force preemption).
    num_blocks: Annotated[
        int | None, msgspec.Meta(description="KV-cache blocks, overriding kv_cache_memory (null: from it)")
    ] = None

    def __post_init__(self) -> None:
        if self.block_size != BLOCK_SIZE_AUTO and not 1 <= self.block_size <= 1024:
            raise ConfigError(f"must be in [1, 1024], got {self.block_size}", "allocator.block_size")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"must be >= 1, got {self.num_blocks}", "allocator.num_blocks")
        if self.kv_cache_memory != KV_MEMORY_AUTO and parse_bytes(self.kv_cache_memory) <= 0:
            raise ConfigError("must be positive", "allocator.kv_cache_memory")


class PagedAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, block_cache: BlockCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_cache = block_cache
        self._refcount = [0] * num_blocks
        # Free blocks in LRU order (oldest first): hashed blocks stay reusable until popped.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._hash_of_block: dict[int, int] = {}
        self._seq_hashes: dict[int, list[int]] = {}  # seq_id -> hash of each full block

    # --- queries ---------------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables.get(seq.seq_id, [])

    def num_free_blocks(self) -> int:
        return len(self._free)

    def owners(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for seq_id, table in self._tables.items():
            for b in table:
                out.setdefault(b, []).append(seq_id)
        return out

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int]:
        """(new blocks to append, shared blocks to copy) for writing the next tokens."""
        table = self._tables.get(seq.seq_id, [])
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        total = -(-end // self.block_size)
        new = max(0, total - len(table))
        first = start // self.block_size
        cow = sum(1 for b in table[first:total] if self._refcount[b] > 1)
        return new, cow

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return sum(self._blocks_needed(seq, num_new_tokens)) <= len(self._free)

    # --- actions ---------------------------------------------------------------------------

    def _pop_free(self) -> int:
        if not self._free:
            raise MemoryError("out of KV-cache blocks")
        block, _ = self._free.popitem(last=False)
        old_hash = self._hash_of_block.pop(block, None)
        if old_hash is not None and self.block_cache is not None:
            self.block_cache.evict(old_hash, block)
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free[block] = None
        elif self._refcount[block] < 0:  # a bookkeeping bug must not go unnoticed
            raise RuntimeError(f"block {block} released more often than referenced")

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        new, cow = self._blocks_needed(seq, num_new_tokens)
        if new + cow > len(self._free):
            raise MemoryError(f"need {new + cow} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq.seq_id, [])
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        copies: list[tuple[int, int]] = []
        for i in range(start // self.block_size, min(len(table), -(-end // self.block_size))):
            src = table[i]
            if self._refcount[src] > 1:
                dst = self._pop_free()
                self._release(src)
                table[i] = dst
                copies.append((src, dst))
        for _ in range(new):
            table.append(self._pop_free())
        if self.block_cache is not None:
            self._register_full_blocks(seq, end)
        return copies

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq.seq_id, None)
        self._seq_hashes.pop(seq.seq_id, None)
        # Release the tail first so a block's descendants are evicted before it (LRU order).
        for b in reversed(table or []):
            self._release(b)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self._tables.get(parent.seq_id, [])
        for b in table:
            self._refcount[b] += 1
        self._tables[child.seq_id] = list(table)
        if parent.seq_id in self._seq_hashes:
            self._seq_hashes[child.seq_id] = list(self._seq_hashes[parent.seq_id])

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        table = self._tables.get(seq.seq_id, [])
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        hashes = self._seq_hashes.get(seq.seq_id)
        if hashes is not None:
            full = num_tokens // self.block_size
            for b in table[full:]:
                # The partly kept block will be overwritten: its content hash is void.
                if self._refcount[b] == 1:
                    old = self._hash_of_block.pop(b, None)
                    if old is not None and self.block_cache is not None:
                        self.block_cache.evict(old, b)
            del hashes[full:]

    # --- content hashes (prefix reuse / tiering seam) -----------------------------------------

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash every block that is full once `num_tokens` tokens are written (draft tokens
        are not part of `seq.token_ids`: blocks they would fill are hashed once accepted)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        table = self._tables[seq.seq_id]
        bs = self.block_size
        full = min(num_tokens, seq.num_tokens) // bs
        if len(hashes) >= min(full, len(table)):
            return
        extra = self._extra_keys(seq)
        while len(hashes) < full and len(hashes) < len(table):
            i = len(hashes)
            h = block_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs], extra)
            hashes.append(h)
            block = table[i]
            if self._hash_of_block.get(block) != h:
                self._hash_of_block[block] = h
                self.block_cache.register(h, block)

    def _extra_keys(self, seq: Sequence) -> bytes:
        cache = self.block_cache
        fingerprint = cache.geometry.fingerprint if cache.geometry is not None else b""
        return fingerprint + cache.request_key(seq.request)

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Attach the longest run of cached full prompt blocks; returns the tokens they hold.
        At least one prompt token is always left to compute, so the step yields logits.

        Blocks resident in device memory are shared; a block the cache holds in a lower tier
        is fetched into a free block (while enough free blocks stay for the rest of the
        prompt). A request asking for prompt logprobs attaches nothing: the skipped positions
        would have no logits, so its whole prompt is recomputed."""
        if self.block_cache is None or seq.seq_id in self._tables:
            return 0
        if seq.request.params.prompt_logprobs is not None:
            return 0
        cache, bs = self.block_cache, self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        rest_blocks = -(-seq.num_tokens // bs)  # blocks the whole sequence will need
        extra = self._extra_keys(seq)
        chain: list[int] = []
        for i in range(max_blocks):
            chain.append(
                block_hash(chain[-1] if chain else None, seq.token_ids[i * bs : (i + 1) * bs], extra)
            )
        cache.prefetch(chain)
        table: list[int] = []
        hashes: list[int] = []
        for h in chain:
            block = cache.lookup(h)
            if block is not None and self._hash_of_block.get(block) == h:
                if self._refcount[block] == 0:
                    del self._free[block]
                self._refcount[block] += 1
            elif cache.holds(h) and len(self._free) > rest_blocks - len(table):
                block = self._pop_free()
                if not cache.fetch(h, block):
                    # No content: the block goes back first in line for reuse.
                    self._refcount[block] = 0
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)
                    break
                self._hash_of_block[block] = h
                cache.register(h, block)
            else:
                break
            table.append(block)
            hashes.append(h)
        if table:
            self._tables[seq.seq_id] = table
            self._seq_hashes[seq.seq_id] = hashes
        return len(table) * bs


def build(options: PagedOptions, ctx: BuildContext) -> PagedAllocator:
    options = msgspec.structs.replace(options, block_size=block_size_of(options, ctx.device))
    if options.num_blocks is not None:
        num_blocks = options.num_blocks
    else:
        per_block = ctx.kv_bytes_per_block
        if per_block is None:
            if ctx.model_config is None:
                raise ValueError("the paged allocator needs the model config to size its blocks")
            per_block = options.block_size * ctx.model_config.kv_bytes_per_token(ctx.kv_cache_dtype.itemsize)
        if options.kv_cache_memory == KV_MEMORY_AUTO:
            budget = kv_budget(ctx.device)
            num_blocks, what = budget.bytes // per_block, f"auto ({budget.reason})"
        else:
            num_blocks = parse_bytes(options.kv_cache_memory) // per_block
            what = str(options.kv_cache_memory)
        if num_blocks < 1:
            raise ConfigError(
                f"{what} holds no block of {per_block} bytes; set a size that does",
                "allocator.kv_cache_memory",
            )
    return PagedAllocator(num_blocks, options.block_size, ctx.block_cache)


COMPONENT = Component(
    name="paged",
    kind="allocator",
    factory=build,
    options_type=PagedOptions,
    description="Paged KV cache: fixed-size ref-counted blocks, block tables, copy-on-write forks.",
    capabilities={"devices": ("cpu", "cuda", "mps"), "fork": True, "truncate": True, "content_hash": True},
)
