"""Allocator conformance: ownership, reference counts, copy-on-write, truncation, no leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lmstack.interfaces import KVAllocator
from lmstack.sequence import Sequence
from lmstack.testing.fakes import make_seq
from lmstack.testing.kit import ComponentKit


def check_invariants(alloc: KVAllocator, live: list[Sequence]) -> None:
    """Every block is either free or referenced by live sequences; none is leaked or doubly
    free; tables are long enough for the computed tokens."""
    refs: Counter[int] = Counter()
    for seq in live:
        table = alloc.block_table(seq)
        assert len(set(table)) == len(table), f"seq {seq.seq_id} holds a block twice: {table}"
        assert len(table) * alloc.block_size >= seq.num_computed_tokens
        refs.update(table)
    used = set(refs)
    assert all(0 <= b < alloc.num_blocks for b in used)
    assert alloc.num_free_blocks() == alloc.num_blocks - len(used), (
        f"{alloc.num_blocks - len(used) - alloc.num_free_blocks()} blocks leaked"
    )
    owners = alloc.owners()
    if owners:
        assert {b: len(s) for b, s in owners.items()} == dict(refs)


class AllocatorConformance(ComponentKit):
    """Set `component` (a registered allocator name or Component) and optionally `options`.

    The kit builds allocators of the sizes each check needs through the factory, passing the
    options `num_blocks` and `block_size` (the allocator must take them: `block_size` is the
    option the engine reads, `num_blocks` overrides a memory budget). Forking is tested when
    the allocator declares `fork`, truncation when it declares `truncate`."""

    kind = "allocator"

    def make_allocator(self, num_blocks: int, block_size: int) -> KVAllocator:
        comp = self.registered()
        missing = [o for o in ("num_blocks", "block_size") if o not in comp.option_names]
        assert not missing, (
            f"allocator {comp.name!r} has no option {' or '.join(missing)}; the allocator kit sizes "
            "allocators with the options num_blocks and block_size"
        )
        alloc = self.build({"num_blocks": num_blocks, "block_size": block_size})
        assert (alloc.num_blocks, alloc.block_size) == (num_blocks, block_size), (
            f"built with num_blocks={num_blocks}, block_size={block_size}, the allocator has "
            f"num_blocks={alloc.num_blocks}, block_size={alloc.block_size}"
        )
        return alloc

    def _declares(self, capability: str) -> bool:
        return bool(self.capabilities().get(capability))

    def _needs(self, capability: str) -> None:
        if not self._declares(capability):
            pytest.skip(f"the allocator declares no {capability}")

    def _grow(self, alloc: KVAllocator, seq: Sequence, n: int) -> list[tuple[int, int]]:
        copies = alloc.allocate(seq, n)
        seq.num_computed_tokens += n
        while len(seq.token_ids) < seq.num_computed_tokens:
            seq.token_ids.append(7)
        return copies

    def test_allocates_as_tokens_arrive(self):
        alloc = self.make_allocator(8, 4)
        seq = make_seq(5)
        assert alloc.can_allocate(seq, 5)
        self._grow(alloc, seq, 5)
        assert len(alloc.block_table(seq)) == 2
        self._grow(alloc, seq, 3)
        assert len(alloc.block_table(seq)) == 2
        self._grow(alloc, seq, 1)
        assert len(alloc.block_table(seq)) == 3
        check_invariants(alloc, [seq])
        alloc.free(seq)
        alloc.free(seq)  # idempotent
        check_invariants(alloc, [])

    def test_refuses_past_capacity(self):
        alloc = self.make_allocator(3, 4)
        seq = make_seq(13)
        assert not alloc.can_allocate(seq, 13)
        with pytest.raises(MemoryError):
            alloc.allocate(seq, 13)
        assert alloc.num_free_blocks() == 3
        assert alloc.can_allocate(seq, 12)

    def test_fork_shares_then_copies_on_write(self):
        self._needs("fork")
        alloc = self.make_allocator(8, 4)
        parent = make_seq(6)
        self._grow(alloc, parent, 6)
        child = make_seq(6)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        alloc.fork(parent, child)
        assert alloc.block_table(child) == alloc.block_table(parent)
        assert alloc.num_free_blocks() == 6
        # Writing token 6 lands in the shared, partly filled second block: it must be copied.
        shared_tail = alloc.block_table(parent)[1]
        copies = self._grow(alloc, child, 1)
        assert copies and copies[0][0] == shared_tail
        assert alloc.block_table(child)[1] != shared_tail
        assert alloc.block_table(child)[0] == alloc.block_table(parent)[0]
        assert not self._grow(alloc, parent, 1)  # parent is the sole owner now
        check_invariants(alloc, [parent, child])
        alloc.free(parent)
        check_invariants(alloc, [child])
        alloc.free(child)
        check_invariants(alloc, [])

    def test_truncate_returns_blocks(self):
        self._needs("truncate")
        alloc = self.make_allocator(8, 4)
        seq = make_seq(3)
        self._grow(alloc, seq, 11)
        assert len(alloc.block_table(seq)) == 3
        alloc.truncate(seq, 5)
        seq.num_computed_tokens = 5
        assert len(alloc.block_table(seq)) == 2
        check_invariants(alloc, [seq])
        self._grow(alloc, seq, 4)
        check_invariants(alloc, [seq])
        alloc.free(seq)
        check_invariants(alloc, [])

    def test_usage_fraction(self):
        alloc = self.make_allocator(10, 4)
        seq = make_seq(4)
        assert alloc.usage() == 0.0
        self._grow(alloc, seq, 8)
        assert alloc.usage() == pytest.approx(0.2)
        alloc.free(seq)
        assert alloc.usage() == 0.0

    @pytest.mark.parametrize("seed", range(5))
    def test_random_operations_never_leak(self, seed):
        rng = random.Random(seed)
        alloc = self.make_allocator(24, rng.choice([1, 2, 4, 16]))
        fork, truncate = self._declares("fork"), self._declares("truncate")
        live: list[Sequence] = []
        for _ in range(300):
            op = rng.random()
            if op < 0.3 or not live:
                seq = make_seq(rng.randint(1, 30))
                n = rng.randint(1, 30)
                if alloc.can_allocate(seq, n):
                    self._grow(alloc, seq, n)
                    live.append(seq)
            elif op < 0.6:
                seq = rng.choice(live)
                n = rng.randint(1, 6)
                if alloc.can_allocate(seq, n):
                    self._grow(alloc, seq, n)
            elif op < 0.7 and fork:
                parent = rng.choice(live)
                child = make_seq(1)
                child.token_ids = list(parent.token_ids)
                child.num_computed_tokens = parent.num_computed_tokens
                alloc.fork(parent, child)
                live.append(child)
            elif op < 0.8 and truncate:
                seq = rng.choice(live)
                keep = rng.randint(0, seq.num_computed_tokens)
                alloc.truncate(seq, keep)
                seq.num_computed_tokens = keep
            elif op >= 0.8:
                seq = live.pop(rng.randrange(len(live)))
                alloc.free(seq)
            check_invariants(alloc, live)
        for seq in live:
            alloc.free(seq)
        check_invariants(alloc, [])
