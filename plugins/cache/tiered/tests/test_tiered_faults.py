"""Disk-tier faults end cleanly: every I/O error of the tiered cache's directory is a miss or a
skipped write with one warning per kind of error, never a failed step or a leaked KV block, and
greedy tokens stay those of the stack without a cache.

Faults are real where the sandbox allows (files deleted under the store, a block file replaced
by a directory, a sparse 3 GiB file, two stores on one directory) and injected otherwise: the
store does all its file I/O through its module's `os`, for which `FaultyOS` stands in (the tests
may run as root, where chmod does not make a directory read-only)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lmstack_tiered_cache.store as store_module
from lmstack.content_hash import CacheGeometry
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack
from lmstack_tiered_cache.store import NAMESPACES, DiskStore, RateLimitedWarnings, encode_block

LOGGER = "lmstack.cache.tiered"
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, politely. "
    "The bakery opens at seven and sells bread, cakes and coffee. "
)
# The first two share a prefix that `populated` stores on disk; the third is another tenant's
# request, new to the directory, so its blocks are written while the others are read.
PROMPTS = [
    SYSTEM + "When do you open?",
    SYSTEM + "Do you sell coffee?",
    "A request from another tenant that shares nothing with the bakery prompts above, long enough.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GIB = 1 << 30


# --- fault injection ---------------------------------------------------------------------------


class FaultyOS:
    """The `os` module as the store sees it. Each keyword names an `os` function and gives an
    errno (every call fails) or a callable taking the call's arguments and returning an errno
    to fail with, or None to let the call through."""

    def __init__(self, **faults: int | Callable[..., int | None]) -> None:
        self.faults = faults
        self.raised: Counter[str] = Counter()

    def __getattr__(self, name: str):
        real = getattr(os, name)
        fault = self.faults.get(name)
        if fault is None:
            return real

        def call(*args, **kwargs):
            code = fault(*args, **kwargs) if callable(fault) else fault
            if code is None:
                return real(*args, **kwargs)
            self.raised[name] += 1
            where = str(args[0]) if args and not isinstance(args[0], int) else None
            raise OSError(code, os.strerror(code), where)

        return call


def opening_for_write(code: int) -> Callable[..., int | None]:
    """`os.open` failing for writes only (what a read-only file system does)."""
    return lambda path, flags, *a, **k: code if flags & (os.O_WRONLY | os.O_RDWR) else None


READ_ONLY = {
    "open": opening_for_write(errno.EROFS),
    "replace": errno.EROFS,
    "unlink": errno.EROFS,
    "rmdir": errno.EROFS,
}


@pytest.fixture
def inject(monkeypatch):
    def go(**faults) -> FaultyOS:
        faulty = FaultyOS(**faults)
        monkeypatch.setattr(store_module, "os", faulty)
        return faulty

    return go


def heal(monkeypatch) -> None:
    monkeypatch.setattr(store_module, "os", os)


def warning_kinds(caplog) -> list[str]:
    """The cache's warnings with block names and numbers left out: one entry per kind."""
    return [
        re.sub(r"[0-9a-f]{32}\S*|\d+", "#", r.getMessage())
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING
    ]


# --- an engine on the tiny model ---------------------------------------------------------------


def tiered_llm(model_path: Path, disk_path: Path, **options):
    from lmstack.engine.llm import LLM

    stack = tiny_stack(model_path)
    stack["cache"] = {"name": "tiered", "disk_path": str(disk_path), "disk_capacity": "64MiB", **options}
    return LLM(stack)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def want(tiny_model_path):
    with one_thread():
        return tokens(reference_llm(tiny_stack(tiny_model_path)).generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def populated(tiny_model_path, tmp_path_factory) -> Path:
    """A directory holding the bakery prompts' blocks, written by a healthy engine."""
    disk = tmp_path_factory.mktemp("populated") / "kv"
    llm = tiered_llm(tiny_model_path, disk)
    with one_thread():
        llm.generate(PROMPTS[:2], GREEDY)
    llm.engine.shutdown()
    assert len(list(disk.glob("*.kv"))) >= 8
    return disk


@pytest.fixture
def disk(populated, tmp_path) -> Path:
    """A copy of `populated` for one test to damage."""
    copy = tmp_path / "kv"
    shutil.copytree(populated, copy)
    return copy


def serve_cleanly(llm, want, caplog) -> None:
    """The requests, batched (each the others' concurrent tenant), give greedy tokens equal to
    the cache-off stack; no exception leaves a step; every KV block is free at the end; at most
    one warning of each kind, and nothing worse."""
    with caplog.at_level(logging.WARNING, logger=LOGGER), one_thread():
        assert tokens(llm.generate(PROMPTS, GREEDY)) == want
        llm.engine.block_cache.flush()  # the writer met its faults too
    eng = llm.engine
    stats = eng.get_stats()
    assert stats.num_kv_blocks - stats.num_free_kv_blocks == 0, "KV blocks leaked"
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks
    kinds = warning_kinds(caplog)
    assert len(kinds) == len(set(kinds)), f"a kind of error warned twice: {kinds}"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def no_temporaries(disk: Path) -> None:
    assert not list(disk.rglob("*.tmp")), "a temporary was left behind"


# --- each fault, through an engine ---------------------------------------------------------------


def test_a_read_only_directory_still_serves_reads_and_skips_writes(
    tiny_model_path, disk, want, inject, caplog
):
    before = sorted(p.name for p in disk.glob("*.kv"))
    faulty = inject(**READ_ONLY)  # from the start, as after a remount read-only
    llm = tiered_llm(tiny_model_path, disk)
    try:
        serve_cleanly(llm, want, caplog)
        cache = llm.engine.block_cache
        assert cache.disk_hits > 0 and cache.store.available
        assert faulty.raised["open"] > 1, "the third prompt's blocks were offered for writing"
        assert sorted(p.name for p in disk.glob("*.kv")) == before
        assert any("cannot write" in k and "Read-only" in k for k in warning_kinds(caplog))
    finally:
        llm.engine.shutdown()


def test_a_directory_that_cannot_be_opened_turns_the_tier_off(tiny_model_path, disk, want, inject, caplog):
    faulty = inject(
        makedirs=errno.EACCES, open=errno.EACCES, scandir=errno.EACCES, stat=errno.EACCES, unlink=errno.EACCES
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llm = tiered_llm(tiny_model_path, disk)  # the engine builds: the tier is only a cache
    try:
        serve_cleanly(llm, want, caplog)
        cache = llm.engine.block_cache
        assert not cache.store.available and cache.disk_hits == 0
        assert cache.status()["disk_tier"] == "off"
        assert faulty.raised["makedirs"] == 1, "a failed open is retried once a minute, not per block"
        assert [k for k in warning_kinds(caplog) if "cannot open" in k]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "faults",
    [
        {"read": errno.EIO},
        {"fstat": errno.EIO},
        {"open": errno.EACCES},
        {"read": errno.EIO, "unlink": errno.EACCES},  # the unreadable file cannot be removed either
    ],
    ids=["read-EIO", "fstat-EIO", "open-EACCES", "read-and-unlink"],
)
def test_failing_reads_are_misses(tiny_model_path, disk, want, inject, caplog, faults):
    llm = tiered_llm(tiny_model_path, disk)
    try:
        faulty = inject(**faults)
        serve_cleanly(llm, want, caplog)
        cache = llm.engine.block_cache
        assert cache.disk_hits == 0
        assert sum(faulty.raised.values()) > 1 and cache.store.io_errors > 1
        no_temporaries(disk)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "faults",
    [{"write": errno.EIO}, {"replace": errno.EXDEV}, {"open": opening_for_write(errno.EDQUOT)}],
    ids=["write-EIO", "rename-EXDEV", "open-EDQUOT"],
)
def test_failing_writes_are_skipped_and_leave_no_temporary(
    tiny_model_path, tmp_path, want, inject, caplog, faults
):
    disk = tmp_path / "kv"
    llm = tiered_llm(tiny_model_path, disk)
    try:
        inject(**faults)
        serve_cleanly(llm, want, caplog)
        store = llm.engine.block_cache.store
        assert store.io_errors > 1 and len(store) == 0 and store.used_bytes == 0
        assert not list(disk.glob("*.kv"))
        no_temporaries(disk)
    finally:
        llm.engine.shutdown()


def test_a_full_disk_evicts_and_later_writes_succeed(
    tiny_model_path, disk, want, inject, monkeypatch, caplog
):
    llm = tiered_llm(tiny_model_path, disk)
    try:
        store = llm.engine.block_cache.store
        held = len(store)
        inject(write=errno.ENOSPC)
        serve_cleanly(llm, want, caplog)
        assert len(store) < held, "ENOSPC evicts the oldest files"
        assert len(list(disk.glob("*.kv"))) == len(store)
        assert store.used_bytes == sum(p.stat().st_size for p in disk.glob("*.kv"))
        no_temporaries(disk)
        assert any("No space left" in k for k in warning_kinds(caplog))
        # Space again: the tier was not turned off, and a block computed again is written.
        heal(monkeypatch)
        with one_thread():
            llm.generate([SYSTEM + "Is there bread today?"], GREEDY, cache_salt="later")
        llm.engine.block_cache.flush()
        assert len(store) > 0 and store.used_bytes == sum(p.stat().st_size for p in disk.glob("*.kv"))
    finally:
        llm.engine.shutdown()


def test_files_deleted_under_the_store_are_plain_misses(tiny_model_path, disk, want, caplog):
    llm = tiered_llm(tiny_model_path, disk)
    try:
        for f in disk.glob("*.kv"):  # another process (an operator, a cleaner) deletes them
            f.unlink()
        serve_cleanly(llm, want, caplog)
        assert llm.engine.block_cache.disk_hits == 0
        assert not warning_kinds(caplog), "a vanished file is an ordinary miss"
    finally:
        llm.engine.shutdown()


def test_block_files_replaced_by_directories(tiny_model_path, disk, want, caplog):
    llm = tiered_llm(tiny_model_path, disk)
    try:
        for f in disk.glob("*.kv"):
            f.unlink()
            (f / "inside").mkdir(parents=True)  # not empty: cannot be removed either
        serve_cleanly(llm, want, caplog)
        assert llm.engine.block_cache.disk_hits == 0
        assert any("not a regular file" in k for k in warning_kinds(caplog))
        no_temporaries(disk)
    finally:
        llm.engine.shutdown()


def test_oversized_sparse_files_are_misses_never_read_whole(tiny_model_path, disk, want, caplog):
    files = sorted(disk.glob("*.kv"))
    stray = disk / ("00" * 16 + ".kv")
    stray.touch()
    os.truncate(stray, 3 * GIB)  # present at start: removed when the directory is indexed
    llm = tiered_llm(tiny_model_path, disk)
    try:
        assert not stray.exists()
        for f in files:
            os.truncate(f, 3 * GIB)  # sparse: no disk space, 3 GiB to whoever reads it whole
        tracemalloc.start()
        try:
            serve_cleanly(llm, want, caplog)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{peak} bytes allocated"
        assert llm.engine.block_cache.disk_hits == 0
        # A chain's first block is read, removed, computed and written again whole; the blocks
        # after it are not asked for.
        assert any(not f.exists() or f.stat().st_size < GIB for f in files), "the file read stays oversized"
        assert any("more than a block file's" in k for k in warning_kinds(caplog))
    finally:
        llm.engine.shutdown()


# --- the store alone -----------------------------------------------------------------------------

BS = 4
GEOMETRY = CacheGeometry("m", "c", "float32", "none", 2, 1, 2, "float32", BS)


def raw_block(h: int) -> bytes:
    data = torch.full(GEOMETRY.block_shape, float(h), dtype=torch.float32)
    return encode_block(GEOMETRY, h, data)


SIZE = len(raw_block(0))


def on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file() and p.name != ".lock")


def test_capacity_counts_the_temporary_being_written(tmp_path, inject):
    store = DiskStore(tmp_path, capacity=3 * SIZE)
    seen = []

    def check(fd, data):  # at every write, what is on disk plus what is being written
        seen.append(on_disk(tmp_path) + len(data))
        return None

    inject(write=check)
    for h in range(8):
        assert store.write(h, raw_block(h))
    assert seen and max(seen) <= 3 * SIZE
    assert store.used_bytes == on_disk(tmp_path) == 3 * SIZE


def test_stale_temporaries_are_swept_and_an_unremovable_one_is_counted(tmp_path, inject, monkeypatch):
    store = DiskStore(tmp_path, capacity=10 * SIZE)
    store.write(1, raw_block(1))
    store.close()
    (tmp_path / "ab.kv.123.456.tmp").write_bytes(b"x" * SIZE)  # a writer that crashed
    store = DiskStore(tmp_path, capacity=10 * SIZE)
    assert store.used_bytes == SIZE and not list(tmp_path.glob("*.tmp"))
    store.close()
    (tmp_path / "cd.kv.1.2.tmp").write_bytes(b"x" * 100)
    inject(unlink=errno.EACCES)
    store = DiskStore(tmp_path, capacity=10 * SIZE)
    assert store.used_bytes == SIZE + 100, "a temporary that cannot be removed still counts"
    heal(monkeypatch)
    for h in range(2, 12):  # filling up evicts it first
        assert store.write(h, raw_block(h))
    assert not list(tmp_path.glob("*.tmp"))
    assert store.used_bytes == on_disk(tmp_path) == 10 * SIZE


def test_a_full_disk_evicts_the_oldest_then_writes_again(tmp_path, inject, monkeypatch, caplog):
    store = DiskStore(tmp_path, capacity=100 * SIZE)
    for h in range(20):
        store.write(h, raw_block(h))
    inject(write=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not store.write(99, raw_block(99))
        assert not store.write(98, raw_block(98))
    assert len(store) == 20 - 2 * store_module.FULL_DISK_EVICT_BLOCKS
    assert 0 not in store and 19 in store, "the least recently used go first"
    assert store.used_bytes == on_disk(tmp_path) and not list(tmp_path.glob("*.tmp"))
    assert len(warning_kinds(caplog)) == 1
    heal(monkeypatch)
    assert store.write(99, raw_block(99)) and 99 in store and store.read(99) == raw_block(99)


def test_files_that_cannot_be_stat_at_start_are_left_out(tmp_path, inject, monkeypatch, caplog):
    store = DiskStore(tmp_path, capacity=10 * SIZE)
    for h in range(3):
        store.write(h, raw_block(h))
    store.close()
    inject(stat=errno.EIO)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = DiskStore(tmp_path, capacity=10 * SIZE)
    assert store.available and len(store) == 0 and store.read(1) is None
    assert len(warning_kinds(caplog)) == 1 and store.io_errors == 3
    heal(monkeypatch)
    assert store.write(1, raw_block(1)) and store.read(1) == raw_block(1)


def test_a_directory_deleted_under_the_store_is_made_again(tmp_path):
    store = DiskStore(tmp_path / "kv", capacity=10 * SIZE)
    store.write(1, raw_block(1))
    shutil.rmtree(tmp_path / "kv")  # an operator clearing the cache
    assert store.read(1) is None and 1 not in store
    assert not store.write(2, raw_block(2))  # one failed write (and one warning)
    assert store.write(3, raw_block(3)) and store.read(3) == raw_block(3)
    assert store.used_bytes == on_disk(tmp_path / "kv") == SIZE


def test_two_stores_on_one_directory_keep_to_their_own_namespaces(tmp_path, caplog):
    first = DiskStore(tmp_path, capacity=2 * SIZE)
    second = DiskStore(tmp_path, capacity=2 * SIZE)  # another server on the same directory
    assert first.root == tmp_path and second.root == tmp_path / "ns1"
    for h in (1, 2):
        first.write(h, raw_block(h))
    for h in (3, 4, 5, 6):  # second evicts its own files only
        second.write(h, raw_block(h))
    assert 1 in first and 2 in first and first.read(1) == raw_block(1)
    assert first.used_bytes == on_disk(tmp_path) == 2 * SIZE
    assert second.used_bytes == on_disk(tmp_path / "ns1") == 2 * SIZE
    # Every namespace taken: the tier is off with one warning, nothing else breaks.
    others = [DiskStore(tmp_path, capacity=SIZE) for _ in range(NAMESPACES - 2)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        late = DiskStore(tmp_path, capacity=SIZE)
        assert not late.available and not late.write(7, raw_block(7)) and late.read(1) is None
    assert len(warning_kinds(caplog)) == 1 and "locked by another server" in caplog.records[0].getMessage()
    # A server that stops releases its lock: a restart on the directory finds its files.
    first.close()
    again = DiskStore(tmp_path, capacity=2 * SIZE)
    assert again.root == tmp_path and 1 in again and 2 in again
    for s in (second, again, *others):
        s.close()


def test_warnings_are_one_per_kind_per_interval(caplog):
    warnings = RateLimitedWarnings(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert warnings.warn("read:EIO", "a %s", 1)
        assert not warnings.warn("read:EIO", "a %s", 2)
        assert warnings.warn("write:EROFS", "b")
        warnings.interval_s = 0
        assert warnings.warn("read:EIO", "a %s", 3)
    assert [r.getMessage() for r in caplog.records] == [
        "a 1",
        "b",
        "a 3 (1 more like it since the last warning)",
    ]


def test_an_oversized_file_is_removed_without_being_read(tmp_path):
    store = DiskStore(tmp_path, capacity=10 * SIZE, file_bytes=SIZE)
    store.write(1, raw_block(1))
    os.truncate(tmp_path / next(p.name for p in tmp_path.glob("*.kv")), 3 * GIB)
    tracemalloc.start()
    try:
        assert store.read(1) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert not list(tmp_path.glob("*.kv")) and 1 not in store and store.used_bytes == 0


def test_a_directory_that_could_not_be_opened_is_tried_again_later(tmp_path, inject, monkeypatch):
    faulty = inject(makedirs=errno.EACCES)
    store = DiskStore(tmp_path / "kv", capacity=10 * SIZE)
    assert not store.available
    heal(monkeypatch)
    assert not store.write(1, raw_block(1)), "not retried within the minute"
    assert faulty.raised["makedirs"] == 1
    monkeypatch.setattr(store_module.time, "monotonic", lambda: 1e12)  # a minute later
    assert store.write(1, raw_block(1)) and store.available and store.read(1) == raw_block(1)


# --- through the HTTP API ------------------------------------------------------------------------


def test_http_stream_completes_and_health_stays_ok_while_the_disk_fails(
    tiny_model_path, disk, want, inject, caplog
):
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    llm = tiered_llm(tiny_model_path, disk)
    engine = llm.engine
    async_engine = AsyncEngine(engine)
    app = create_app(engine.stack, ServerState(engine.stack, async_engine))
    inject(read=errno.EIO, **READ_ONLY)  # every read and every write fails
    text = reference_llm(tiny_stack(tiny_model_path)).tokenizer.decode(want[0][0])
    try:
        with TestClient(app) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
            body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = client.post("/v1/completions", json={**body, "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text, r.text
            plain = client.post("/v1/completions", json=body)
            assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == text
            assert client.get("/health").status_code == 200
            described = client.get("/v1/stack")
            assert described.status_code == 200
            assert str(disk) not in described.text and str(disk.parent) not in described.text
            assert described.json()["stack"]["components"]["cache"]["options"]["disk_path"] == "[redacted]"
            tier = described.json()["engine"]["cache"]
            assert tier["disk_tier"] == "on" and tier["disk_io_errors"] > 0 and tier["disk_hits"] == 0
            metrics = client.get("/metrics").text
            assert re.search(r"^lmstack:kv_cache_blocks_used\{[^}]*\} 0(\.0)?$", metrics, re.M), metrics
        assert engine.block_cache.store.io_errors > 0
    finally:
        async_engine.shutdown()
        engine.shutdown()
