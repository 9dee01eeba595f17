"""The disk tier without a model: file format checks, capacity, and two cache instances
(a restart) on one directory, driven through the reference allocator."""

from __future__ import annotations

import logging

import pytest
import torch

from lmstack.components.paged import PagedAllocator
from lmstack.content_hash import CacheGeometry
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request, Sequence
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack_tiered_cache import DiskStore, TieredCache, TieredCacheOptions
from lmstack_tiered_cache.store import CorruptEntry, decode_block, encode_block

BS = 4
GEOMETRY = CacheGeometry("m", "c", "float32", "none", 2, 1, 2, "float32", BS)
PROMPT = list(range(10, 23))  # 3 full blocks + 1 token


def block(seed: float) -> torch.Tensor:
    return (
        torch.arange(torch.Size(GEOMETRY.block_shape).numel(), dtype=torch.float32).reshape(
            GEOMETRY.block_shape
        )
        + seed
    )


def tiered(path, **kw) -> TieredCache:
    c = TieredCache(TieredCacheOptions(disk_path=str(path), **kw))
    c.bind(GEOMETRY)
    return c


def seq(prompt: list[int]) -> Sequence:
    req = Request(f"r{id(prompt)}", list(prompt), SamplingParams(max_tokens=2, temperature=0.0))
    s = Sequence(id(req), req, list(prompt))
    req.seqs.append(s)
    return s


def run_prompt(alloc: PagedAllocator, cache: TieredCache, s: Sequence) -> tuple[int, list]:
    """Admit and 'compute' like the engine: returns (cached tokens, blocks swapped in). The
    copy-out hands each block a tensor derived from its position so a reload can be checked."""
    cached = s.num_computed_tokens = alloc.attach_cached_prefix(s)
    alloc.allocate(s, s.num_tokens - cached)
    swap_in, swap_out = cache.take_transfers()
    table = alloc.block_table(s)
    cache.offloaded(swap_out, [block(float(table.index(b))) for b in swap_out])
    s.num_computed_tokens = s.num_tokens
    return cached, swap_in


def test_the_component_is_registered_as_persistent():
    c = build_registry(make_plugin_manager()).get("cache", "tiered")
    assert c.capabilities["persistent"] is True and c.distribution == "lmstack-tiered-cache"


def test_a_block_file_round_trips_and_every_defect_is_caught():
    raw = encode_block(GEOMETRY, 42, block(1.0))
    assert torch.equal(decode_block(raw, GEOMETRY, 42, torch.float32), block(1.0))
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_block(bytes(flipped), GEOMETRY, 42, torch.float32)
    with pytest.raises(CorruptEntry):
        decode_block(raw[: len(raw) - 9], GEOMETRY, 42, torch.float32)
    with pytest.raises(CorruptEntry, match="truncated"):
        decode_block(raw[:5], GEOMETRY, 42, torch.float32)
    with pytest.raises(CorruptEntry, match="foreign block: hash"):
        decode_block(raw, GEOMETRY, 43, torch.float32)
    other = CacheGeometry("m", "c", "float32", "none", 2, 1, 2, "bfloat16", BS)
    with pytest.raises(CorruptEntry, match="foreign block: fingerprint"):
        decode_block(raw, other, 42, torch.bfloat16)


def test_capacity_evicts_least_recently_used_files(tmp_path):
    size = len(encode_block(GEOMETRY, 1, block(0)))
    store = DiskStore(tmp_path, capacity=3 * size)
    for h in (1, 2, 3):
        store.write(h, encode_block(GEOMETRY, h, block(h)))
    assert store.read(1) is not None  # 1 is now the most recent
    store.write(4, encode_block(GEOMETRY, 4, block(4)))
    assert 2 not in store and all(h in store for h in (1, 3, 4))
    assert store.used_bytes <= 3 * size
    assert len(list(tmp_path.glob("*.kv"))) == 3
    # A new store on the directory (a restart, after the first released its lock) finds them again.
    store.close()
    assert len(DiskStore(tmp_path, capacity=3 * size)) == 3


def test_a_second_instance_on_the_directory_loads_the_blocks_back(tmp_path):
    first = tiered(tmp_path)
    alloc = PagedAllocator(8, BS, first)
    assert run_prompt(alloc, first, seq(PROMPT)) == (0, [])
    first.close()
    assert len(list(tmp_path.glob("*.kv"))) == 3

    again = tiered(tmp_path)  # a restarted server: empty device pool, same directory
    alloc2 = PagedAllocator(8, BS, again)
    s = seq(PROMPT)
    cached, swap_in = run_prompt(alloc2, again, s)
    assert cached == 12
    table = alloc2.block_table(s)
    assert [b for b, _ in swap_in] == table[:3]
    for i, (_, data) in enumerate(swap_in):
        assert torch.equal(data, block(float(i)))
    assert again.disk_hits == 3
    again.close()


def test_damaged_files_are_misses_with_a_log_line(tmp_path, caplog):
    first = tiered(tmp_path)
    run_prompt(PagedAllocator(8, BS, first), first, seq(PROMPT))
    first.close()
    # Damage the second block's file: the first block still loads, the rest is computed.
    by_block = {}  # block position in the prompt -> its file (block(i) starts with i)
    for f in tmp_path.glob("*.kv"):
        h = int.from_bytes(bytes.fromhex(f.stem), "little")
        by_block[int(decode_block(f.read_bytes(), GEOMETRY, h, torch.float32).flatten()[0])] = f
    assert sorted(by_block) == [0, 1, 2]
    raw = bytearray(by_block[1].read_bytes())
    raw[40] ^= 0xFF
    by_block[1].write_bytes(bytes(raw))

    again = tiered(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lmstack.cache.tiered"):
        cached, swap_in = run_prompt(PagedAllocator(8, BS, again), again, seq(PROMPT))
    assert cached == 4 and len(swap_in) == 1
    assert again.disk_misses == 1
    assert any("unusable" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    again.close()
    # The damaged file was dropped, and the block computed instead was written again, whole.
    h1 = int.from_bytes(bytes.fromhex(by_block[1].stem), "little")
    assert torch.equal(decode_block(by_block[1].read_bytes(), GEOMETRY, h1, torch.float32), block(1.0))


def test_bad_options_name_the_key():
    from lmstack.errors import ConfigError

    with pytest.raises(ConfigError, match="cache.disk_capacity"):
        TieredCacheOptions(disk_path="/tmp/x", disk_capacity="lots")
