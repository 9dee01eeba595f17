"""`continuous`: iteration-level continuous batching (Orca) with chunked prefill (Sarathi),
a per-step token budget, a cap on running sequences, and preemption by recompute.

Order is FCFS by default; subclasses change it by overriding `waiting_order_key` (the example
priority plugin does), and everything else — budgets, chunking, preemption — comes along.
"""

from __future__ import annotations

import msgspec

from lmstack.errors import ConfigError
from lmstack.interfaces import (
    BuildContext,
    EngineLimits,
    KVAllocator,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
)
from lmstack.registry import Component
from lmstack.sequence import Sequence, SequenceStatus


class ContinuousOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Split long prompts into chunks that share steps with running decodes.
    chunked_prefill: bool = True
    # Cap one prompt's chunk so a single long prompt cannot take the whole budget (0: no cap).
    max_prefill_chunk: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", f"scheduler.{name}")
        if self.max_prefill_chunk < 0:
            raise ConfigError("must be >= 0", "scheduler.max_prefill_chunk")


class ContinuousScheduler(Scheduler):
    def __init__(self, options: ContinuousOptions, allocator: KVAllocator, limits: EngineLimits) -> None:
        self.options = options
        self.allocator = allocator
        self.max_num_seqs = options.max_num_seqs
        self.token_budget = options.max_num_batched_tokens
        if not options.chunked_prefill and self.token_budget < limits.max_model_len:
            # Without chunking a whole prompt must fit in one step.
            self.token_budget = limits.max_model_len
        self.chunk_cap = options.max_prefill_chunk or self.token_budget
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._num_preemptions = 0

    # --- ordering (override in subclasses) -------------------------------------------------

    def waiting_order_key(self, seq: Sequence) -> tuple:
        """Lower is admitted first and preempted last. FCFS: arrival time, then id."""
        return (seq.arrival_time, seq.seq_id)

    # --- bookkeeping -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        # A fork (n > 1) arrives already holding its parent's blocks.
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).append(seq)

    def finish(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.allocator.free(seq)

    def running_seqs(self) -> list[Sequence]:
        return list(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def _seq_slots(self, seq: Sequence) -> int:
        """Running slots a waiting sequence will take: n for a request not yet forked."""
        req = seq.request
        return req.params.n if len(req.seqs) < req.params.n else 1

    # --- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        self.running.sort(key=self.waiting_order_key)

        # 1. Running sequences first: decodes and prefill chunks in progress.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = seq.num_uncomputed_tokens + len(seq.draft_token_ids)
            n = min(want, budget, self.chunk_cap if seq.is_prefill else want)
            if n < want and seq.draft_token_ids:
                seq.draft_token_ids = []  # no room to verify drafts this step
                n = min(seq.num_uncomputed_tokens, budget)
            # Out of blocks: preempt the lowest-ranked running sequence (maybe this one).
            while not self.allocator.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.blocks_to_copy += self.allocator.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # 2. Admit waiting sequences, unless this step had to preempt (no room anyway).
        if not out.preempted:
            self.waiting.sort(key=self.waiting_order_key)
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if len(self.running) + self._seq_slots(seq) > self.max_num_seqs and self.running:
                    break
                if seq.num_computed_tokens == 0:
                    seq.num_computed_tokens = self.allocator.attach_cached_prefix(seq)
                want = seq.num_uncomputed_tokens
                n = min(want, budget, self.chunk_cap)
                if (n < want and not self.options.chunked_prefill) or not self.allocator.can_allocate(seq, n):
                    break
                self.waiting.pop(0)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.blocks_to_copy += self.allocator.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out


def build(options: ContinuousOptions, ctx: BuildContext) -> ContinuousScheduler:
    assert ctx.allocator is not None and ctx.limits is not None
    return ContinuousScheduler(options, ctx.allocator, ctx.limits)


COMPONENT = Component(
    name="continuous",
    kind="scheduler",
    factory=build,
    options_type=ContinuousOptions,
    description="Continuous batching, FCFS, chunked prefill, preemption by recompute.",
    capabilities={"chunked_prefill": True, "preemption": "recompute", "devices": ("cpu", "cuda", "mps")},
)
