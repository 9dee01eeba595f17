"""Scheduler conformance: budgets, chunking, preemption, abort, every request finishes, no leaks.

`simulate` plays the engine's part without a model: it advances computed tokens by what was
scheduled and appends a token whenever a sequence's step reaches its newest token.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from lmstack.interfaces import EngineLimits, KVAllocator, Scheduler, SchedulerOutput
from lmstack.registry import Component
from lmstack.sequence import FinishReason, Sequence, SequenceStatus
from lmstack.testing.allocator import check_invariants
from lmstack.testing.components import build_component
from lmstack.testing.fakes import make_seq
from lmstack.testing.kit import ComponentKit


def advance(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Play one step without a model: the scheduled tokens computed, a token appended where a
    sequence reached its newest one, finished (and handed back to `sched`) at max_tokens.
    Returns the sequences that finished."""
    done = []
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.LENGTH
                sched.finish(seq)
                done.append(seq)
    return done


def simulate(
    sched: Scheduler,
    alloc: KVAllocator,
    seqs: list[Sequence],
    *,
    limits: EngineLimits,
    arrivals: dict[int, list[Sequence]] | None = None,
    abort_at: dict[int, list[Sequence]] | None = None,
    max_steps: int = 10_000,
) -> list[Sequence]:
    """Run to completion; returns sequences in the order they finished. Checks the scheduler
    contract at every step."""
    for s in seqs:
        sched.add(s)
    live = list(seqs)
    finished: list[Sequence] = []
    arrivals, abort_at = arrivals or {}, abort_at or {}
    for step in range(max_steps):
        for s in arrivals.get(step, []):
            sched.add(s)
            live.append(s)
        for s in abort_at.get(step, []):
            if not s.is_finished:
                s.status = SequenceStatus.FINISHED
                s.finish_reason = FinishReason.ABORT
                sched.finish(s)
                live.remove(s)
                finished.append(s)
        if not sched.has_unfinished() and step > max(arrivals, default=-1):
            break
        out = sched.schedule()
        seen = [x.seq.seq_id for x in out.scheduled]
        assert len(seen) == len(set(seen)), "a sequence was scheduled twice in one step"
        assert out.num_batched_tokens <= limits.max_num_batched_tokens
        assert sched.num_running() <= limits.max_num_seqs
        for item in out.scheduled:
            seq = item.seq
            assert item.num_tokens >= 1
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_tokens <= seq.num_uncomputed_tokens + len(seq.draft_token_ids)
            assert (
                len(alloc.block_table(seq)) * alloc.block_size >= seq.num_computed_tokens + item.num_tokens
            ), "scheduled tokens without KV slots"
        for s in out.preempted:
            assert s.num_computed_tokens == 0 and not alloc.block_table(s)
        check_invariants(alloc, [s for s in live if s.status is SequenceStatus.RUNNING])
        for seq in advance(sched, out):
            live.remove(seq)
            finished.append(seq)
    else:
        raise AssertionError(f"not finished after {max_steps} steps: scheduler stalled")
    assert not live, f"{len(live)} sequences never finished"
    check_invariants(alloc, [])
    return finished


class SchedulerConformance(ComponentKit):
    """Set `component` (a registered scheduler name or Component) and optionally `options`.

    The kit builds the scheduler through its factory over a fresh allocator (`allocator`, a
    registered allocator name or Component, built through its factory too) and `EngineLimits`,
    and passes the limits' `max_num_seqs` / `max_num_batched_tokens` as options when the
    options type has them (as the engine sizes its limits from them). Chunked prefill is tested
    when the scheduler declares `chunked_prefill` (and its option of that name, if any, is on),
    preemption when it declares `preemption`."""

    kind = "scheduler"
    allocator: ClassVar[str | Component] = "paged"

    def _setup(self, *, blocks=64, bs=4, seqs=8, tokens=32, model_len=256):
        alloc = build_component(self.allocator, "allocator", {"num_blocks": blocks, "block_size": bs})
        assert alloc.num_blocks == blocks and alloc.block_size == bs, (
            "the scheduler kit sizes its allocator with the options num_blocks and block_size"
        )
        limits = EngineLimits(max_model_len=model_len, max_num_seqs=seqs, max_num_batched_tokens=tokens)
        sched = self.build(
            {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}, allocator=alloc, limits=limits
        )
        return alloc, limits, sched

    def test_all_requests_finish_within_limits(self):
        alloc, limits, sched = self._setup()
        seqs = [
            make_seq(p, m) for p, m in [(5, 3), (40, 5), (1, 9), (17, 2), (33, 4), (8, 8), (2, 1), (60, 3)]
        ]
        done = simulate(sched, alloc, seqs, limits=limits)
        assert sorted(s.seq_id for s in done) == sorted(s.seq_id for s in seqs)
        assert all(s.num_output_tokens == s.request.params.max_tokens for s in done)

    def test_long_prompt_is_chunked_alongside_decodes(self):
        if not self.capabilities().get("chunked_prefill"):
            pytest.skip("the scheduler declares no chunked_prefill")
        if getattr(self.converted_options(), "chunked_prefill", True) is False:
            pytest.skip("chunked prefill is switched off by the kit's options")
        alloc, limits, sched = self._setup(tokens=16)
        short = make_seq(4, 12)
        sched.add(short)
        for _ in range(2):  # get `short` decoding
            out = sched.schedule()
            for it in out.scheduled:
                it.seq.num_computed_tokens += it.num_tokens
                if it.seq.num_computed_tokens == it.seq.num_tokens:
                    it.seq.token_ids.append(3)
        long = make_seq(50, 2)
        sched.add(long)
        out = sched.schedule()
        by_id = {it.seq.seq_id: it.num_tokens for it in out.scheduled}
        assert by_id.get(short.seq_id) == 1, "the running decode must keep going"
        assert 0 < by_id.get(long.seq_id, 0) < 50, "the long prompt must be split into chunks"

    def test_preemption_when_blocks_run_out(self):
        if not self.capabilities().get("preemption"):
            pytest.skip("the scheduler declares no preemption")
        alloc, limits, sched = self._setup(blocks=12, bs=4, tokens=64, model_len=48)
        seqs = [make_seq(10, 14) for _ in range(4)]  # 4 x 24 tokens = 24 blocks > 12
        done = simulate(sched, alloc, seqs, limits=limits)
        assert len(done) == 4
        assert sched.num_preemptions > 0

    def test_arrivals_and_aborts(self):
        alloc, limits, sched = self._setup()
        first = [make_seq(12, 6) for _ in range(3)]
        late = [make_seq(7, 4) for _ in range(3)]
        done = simulate(
            sched, alloc, first, limits=limits, arrivals={2: late}, abort_at={3: [first[1], late[0]]}
        )
        reasons = {s.seq_id: s.finish_reason for s in done}
        assert reasons[first[1].seq_id] is FinishReason.ABORT
        assert reasons[late[0].seq_id] is FinishReason.ABORT
        assert sum(r is FinishReason.LENGTH for r in reasons.values()) == 4

    def test_respects_max_num_seqs(self):
        alloc, limits, sched = self._setup(seqs=2, tokens=64)
        seqs = [make_seq(3, 5) for _ in range(5)]
        simulate(sched, alloc, seqs, limits=limits)
