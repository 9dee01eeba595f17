"""`tiered`: prefix reuse in device memory (as `prefix`) plus a disk tier.

Every full block is written through to disk once computed: the allocator registers it while
scheduling, the same step's plan asks the executor to copy it out after the forward
(`StepPlan.swap_out`), and a writer thread encodes, checksums and writes it, so the engine
thread only pays for a host copy. Writing at computation (not at eviction from device memory)
means a restart or a crash loses at most the blocks still queued. When a new request's prefix is not in device memory
but on disk, the block is read, checked and loaded into a free device block before the step
that needs it (`StepPlan.swap_in`). The directory outlives the process: a restarted server finds
earlier prefixes.

On a CPU device the device pool *is* host memory, so there is no separate host tier.

The disk is a cache: no error of its (`store` has the list) ever fails an engine step. A read
that fails is a miss (the block is computed), a write that fails is a block not stored.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Annotated

import msgspec
import torch

from lmstack.components.paged import parse_bytes
from lmstack.content_hash import CacheGeometry, hash_hex
from lmstack.errors import ConfigError
from lmstack_prefix_cache import PrefixCache
from lmstack_tiered_cache.store import (
    CorruptEntry,
    DiskStore,
    RateLimitedWarnings,
    block_file_bytes,
    decode_block,
    encode_block,
)


class TieredCacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    disk_path: Annotated[str, msgspec.Meta(description="directory of the disk tier")]
    disk_capacity: Annotated[
        int | str, msgspec.Meta(description='size of the disk tier, bytes or "20GiB"')
    ] = "20GiB"
    share_across_tenants: Annotated[
        bool,
        msgspec.Meta(description="tenants with the same prompt share blocks (faster; leaks prefix timing)"),
    ] = False
    # Blocks waiting for the writer thread; past this, new blocks are not written (a cache may
    # skip a write; it must never block the engine).
    max_pending_writes: Annotated[
        int,
        msgspec.Meta(description="blocks queued for the disk writer; past it, new blocks are not written"),
    ] = 512

    def __post_init__(self) -> None:
        if not self.disk_path:
            raise ConfigError("must name a directory", "cache.disk_path")
        if parse_bytes(self.disk_capacity, "cache.disk_capacity") <= 0:
            raise ConfigError("must be positive", "cache.disk_capacity")
        if self.max_pending_writes < 1:
            raise ConfigError("must be >= 1", "cache.max_pending_writes")


class TieredCache(PrefixCache):
    def __init__(self, options: TieredCacheOptions) -> None:
        super().__init__(options)  # type: ignore[arg-type]  # shares share_across_tenants
        self.options = options
        self._capacity = parse_bytes(options.disk_capacity, "cache.disk_capacity")
        # Opened in `bind`, which says how large a block file is (reads are bounded by it).
        self.store: DiskStore | None = None
        self.warnings = RateLimitedWarnings()
        self._dtype = torch.float32
        self._copy_out: dict[int, int] = {}  # block id -> hash: to copy out after this step
        self._in_flight: list[int] = []  # hashes of the blocks asked for, in order
        self._swap_in: list[tuple[int, torch.Tensor]] = []
        self._pending: set[int] = set()  # hashes queued for the writer
        self._queue: queue.Queue = queue.Queue()
        # Reads of a new request's blocks, started in parallel before the allocator asks for
        # them one by one (file reads and checksums release the GIL).
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmstack-kv-read")
        self._reads: dict[int, Future] = {}
        self._writer: threading.Thread | None = None
        self.disk_hits = 0  # blocks loaded from disk
        self.disk_misses = 0  # corrupt or foreign entries
        self.dropped_writes = 0

    def status(self) -> dict[str, object]:
        """How the disk tier is doing, for operators (`/v1/stack`): the tier being off or
        failing is not an engine failure, so `/health` does not say it."""
        store = self.store
        return {
            "disk_tier": "on" if store is not None and store.available else "off",
            "disk_files": len(store) if store is not None else 0,
            "disk_used_bytes": store.used_bytes if store is not None else 0,
            "disk_hits": self.disk_hits,
            "disk_misses": self.disk_misses,
            "disk_io_errors": store.io_errors if store is not None else 0,
            "dropped_writes": self.dropped_writes,
        }

    def bind(self, geometry: CacheGeometry) -> None:
        super().bind(geometry)
        self._dtype = getattr(torch, geometry.kv_cache_dtype)  # a torch dtype name, e.g. bfloat16
        self.store = DiskStore(
            self.options.disk_path,
            self._capacity,
            block_file_bytes(geometry, self._dtype),
            warnings=self.warnings,
        )

    # --- device tier -------------------------------------------------------------------------

    def register(self, block_hash: int, block_id: int) -> None:
        super().register(block_hash, block_id)
        if block_hash not in self._pending and block_hash not in self.store:
            self._copy_out[block_id] = block_hash

    def evict(self, block_hash: int, block_id: int) -> None:
        super().evict(block_hash, block_id)
        # Not computed (rolled back) or about to be overwritten: nothing to copy out.
        if self._copy_out.get(block_id) == block_hash:
            del self._copy_out[block_id]

    # --- lower tier --------------------------------------------------------------------------

    def holds(self, block_hash: int) -> bool:
        return block_hash in self.store

    def prefetch(self, block_hashes: list[int]) -> None:
        for h in block_hashes:
            if self.lookup(h) is not None or h in self._reads:
                continue
            if h not in self.store:
                break  # the chain of stored blocks ends here
            self._reads[h] = self._readers.submit(self._load, h)

    def _load(self, block_hash: int) -> torch.Tensor | None:
        """Read and check one block (raises CorruptEntry); None when it is not stored."""
        raw = self.store.read(block_hash)
        if raw is None:
            return None
        assert self.geometry is not None
        return decode_block(raw, self.geometry, block_hash, self._dtype)

    def fetch(self, block_hash: int, block_id: int) -> bool:
        read = self._reads.pop(block_hash, None)
        try:
            data = read.result() if read is not None else self._load(block_hash)
        except CorruptEntry as exc:
            self.disk_misses += 1
            self.warnings.warn(
                "corrupt",
                "disk tier: block %s is unusable (%s); treated as a miss",
                hash_hex(block_hash),
                exc,
            )
            self.store.discard(block_hash)
            return False
        if data is None:
            return False
        self.disk_hits += 1
        self._swap_in.append((block_id, data))
        return True

    def take_transfers(self) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
        # Reads the allocator did not use (it stopped early: no free blocks) are dropped.
        for read in self._reads.values():
            read.cancel()
        self._reads.clear()
        swap_in, self._swap_in = self._swap_in, []
        blocks = list(self._copy_out)
        self._in_flight = [self._copy_out[b] for b in blocks]
        self._copy_out = {}
        return swap_in, blocks

    def offloaded(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        for block_hash, tensor in zip(self._in_flight, data, strict=True):
            if block_hash in self._pending:
                continue
            if self._queue.qsize() >= self.options.max_pending_writes:
                self.dropped_writes += 1
                continue
            self._pending.add(block_hash)
            self._queue.put((block_hash, tensor))
        self._in_flight = []
        self._ensure_writer()

    # --- the writer thread ---------------------------------------------------------------------

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="lmstack-kv-disk", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        assert self.geometry is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                block_hash, tensor = item
                try:
                    # The store turns every I/O error into a skipped write (and a warning).
                    self.store.write(block_hash, encode_block(self.geometry, block_hash, tensor))
                finally:
                    # Not stored (a fault, no room): offered again when next computed.
                    self._pending.discard(block_hash)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        self.flush()
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmstack-kv-read")
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None
        if self.store is not None:
            self.store.close()  # releases the directory's lock; a later write takes it again
