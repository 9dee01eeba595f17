"""`continuous`: iteration-level continuous batching (Orca) with chunked prefill (Sarathi),
a per-step token budget, a cap on running sequences, and preemption by recompute.

Prefill that does not starve decode: a step that runs prefill chunks beside running decodes
takes as long as its largest part, so every running stream waits for the chunk. While streams
are decoding, the prefill tokens of a step are sized from the engine's measured step cost
(`lmstack.engine.step_cost`, t(T) = a + b * T) so that the step is predicted to take at most
`max_step_ratio` times what the decodes alone would take (and at most `max_step_ms`, if set).
Without running decodes, or before two step sizes are measured, prompts get the whole budget;
so they do when no running request is streamed (`Request.streamed`): a caller that reads a
request only when it ends sees its total time, which smaller chunks (more steps, each reading
every weight) lengthen: offline batches ran ~7 % faster without it (median, 2-core Zen 4).
A chunk never drops below `MIN_PREFILL_TOKENS`, so new requests always progress.

Order is FCFS by default; subclasses change it by overriding `waiting_order_key` (the example
priority plugin does), and everything else — budgets, chunking, preemption — comes along.

Fair share between requests (`fair_share`): one request (or one call's prompts, a
`Request.group`) may ask for hundreds of sequences, which FCFS would run before anything that
arrives later. Instead, waiting sequences are admitted round-robin across owners (fewest
running sequences first, then the order above), and a newly arrived owner with nothing running
gets its room at once: when the running slots (or KV blocks) are all taken, the newest
sequences of the owner holding the most are preempted, down to an equal share of
`max_num_seqs` and no further; prompts in progress leave room in the step for its first
chunk. Echoed prompt logprobs, the costliest prompt tokens, run at most
`PROMPT_LOGPROB_TOKENS` a step. A small request waits about a step for a slot, whatever runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Annotated

import msgspec

from lmstack.engine.step_cost import StepCostModel
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

# The fewest prefill tokens a step gives prompts while streams decode: below this a prompt's
# time to first token grows with little gain in the gap between tokens.
MIN_PREFILL_TOKENS = 16
# The most prompt tokens per step, over all requests, whose prompt logprobs are computed (echo
# with logprobs): each is a full-vocabulary row of the head and a log-softmax, many times a
# plain prompt token's cost on a small model. Steps of 1,024 such rows took ~6 s on 2 busy
# cores (SmolLM2-135M, vocabulary 49,152), and every request batched with them, or arriving
# meanwhile, waited for each; at 64 a 4-token request beside a 4,000-token echo took 2.1 s
# (128: 4.4 s) and the echo itself no longer (22.5 s), its cost being per row, not per step.
PROMPT_LOGPROB_TOKENS = 64


class ContinuousOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, msgspec.Meta(description="the most sequences running at once")] = 64
    max_num_batched_tokens: Annotated[
        int, msgspec.Meta(description="the most tokens one step computes, prompt chunks and decodes together")
    ] = 2048
    # Split long prompts into chunks that share steps with running decodes.
    chunked_prefill: Annotated[
        bool, msgspec.Meta(description="split long prompts into chunks that share steps with running decodes")
    ] = True
    # Cap one prompt's chunk so a single long prompt cannot take the whole budget (0: no cap).
    max_prefill_chunk: Annotated[
        int, msgspec.Meta(description="the most tokens of one prompt per step (0: no cap)")
    ] = 0
    # While streams decode, a step carrying prefill is predicted to take at most this many
    # times the decode-only step (measured step cost; 0: no limit). Bounds the gap between a
    # stream's tokens (ITL P99) at the price of more steps per prompt (TTFT).
    max_step_ratio: Annotated[
        float, msgspec.Meta(description="a step with prefill over a decode-only one, at most (0: no limit)")
    ] = 2.5
    # An absolute bound on such a step, in milliseconds (0: none).
    max_step_ms: Annotated[
        float, msgspec.Meta(description="the longest such step, in milliseconds (0: no bound)")
    ] = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", f"scheduler.{name}")
        if self.max_prefill_chunk < 0:
            raise ConfigError("must be >= 0", "scheduler.max_prefill_chunk")
        if self.max_step_ratio != 0 and self.max_step_ratio < 1:
            raise ConfigError(
                f"must be 0 (off) or >= 1, got {self.max_step_ratio}", "scheduler.max_step_ratio"
            )
        if self.max_step_ms < 0:
            raise ConfigError("must be >= 0", "scheduler.max_step_ms")


class ContinuousScheduler(Scheduler):
    # Share slots between owners (module docstring); a subclass may turn it off.
    fair_share: bool = True

    def __init__(
        self,
        options: ContinuousOptions,
        allocator: KVAllocator,
        limits: EngineLimits,
        step_cost: StepCostModel | None = None,
    ) -> None:
        """`step_cost`: the engine's measured step cost (None: prefill is never sized by time)."""
        self.options = options
        self.step_cost = step_cost
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

    @staticmethod
    def owner(seq: Sequence) -> str:
        """Whom a sequence's slot counts against for the fair share: its request's group (one
        HTTP call's prompts), else its request."""
        req = seq.request
        return req.group or req.request_id

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

    def prefill_allowance(self) -> int:
        """Prefill tokens this step may carry beside the running decodes (see the module
        docstring); the token budget when no stream decodes or nothing is measured yet."""
        decoding = [s for s in self.running if not s.is_prefill]
        decodes = sum(1 + len(s.draft_token_ids) for s in decoding)
        o = self.options
        # Without chunking a prompt runs whole or not at all: sizing it would only delay it.
        timed = o.chunked_prefill and self.step_cost is not None and (o.max_step_ratio or o.max_step_ms)
        # Only a stream read as it comes sees the gap between its tokens; requests read whole
        # (offline batches, non-streaming calls) finish sooner with fewer, fuller steps.
        if decodes == 0 or not timed or not any(s.request.streamed for s in decoding):
            return self.token_budget
        fit = self.step_cost.fit()
        if fit is None or fit[1] <= 0:
            return self.token_budget
        a, b = fit
        limits = []
        if o.max_step_ratio:
            limits.append(o.max_step_ratio * (a + b * decodes))
        if o.max_step_ms:
            limits.append(o.max_step_ms / 1000.0)
        tokens = int((min(limits) - a) / b) - decodes
        return max(MIN_PREFILL_TOKENS, min(tokens, self.token_budget))

    def _make_room_for_newcomer(self, out: SchedulerOutput) -> int:
        """Preempt the largest owner's newest sequences (never below an equal share of
        `max_num_seqs`) until the first waiting sequence of an owner with nothing running fits
        in slots and KV blocks. Returns the prompt tokens to keep for it in this step's budget
        (at most half the budget; 0 when nobody new waits or it cannot run yet). Needs
        `self.waiting` sorted by `waiting_order_key`."""
        running = Counter(self.owner(s) for s in self.running)
        seq = next((s for s in self.waiting if self.owner(s) not in running), None)
        if seq is None:
            return 0
        first_chunk = min(seq.num_uncomputed_tokens, self.chunk_cap, self.token_budget)
        fits = len(self.running) + self._seq_slots(seq) <= self.max_num_seqs and self.allocator.can_allocate(
            seq, first_chunk
        )
        if fits:
            return min(first_chunk, self.token_budget // 2)
        if running.most_common(1)[0][1] <= 1:
            return 0  # nobody holds more than one slot: nothing to share (a batch of prompts)
        owners = len(set(running) | {self.owner(s) for s in self.waiting})
        share = max(1, self.max_num_seqs // owners)
        if self._seq_slots(seq) > share:
            return 0  # it would hold more than a share itself: the next newcomer would take it back
        while self.running and (
            len(self.running) + self._seq_slots(seq) > self.max_num_seqs
            or not self.allocator.can_allocate(seq, first_chunk)
        ):
            hog, held = running.most_common(1)[0]
            if held <= share:
                return 0  # every owner is within its share: the newcomer waits its turn
            victim = max((s for s in self.running if self.owner(s) == hog), key=self.waiting_order_key)
            self._preempt(victim, out)
            running[hog] -= 1
        return min(first_chunk, self.token_budget // 2)

    def _admission_order(self) -> Iterator[Sequence]:
        """Waiting sequences in the order to admit them (`self.waiting` sorted by
        `waiting_order_key`). With `fair_share`: round-robin across owners, the owner with the
        fewest running sequences next (counting those admitted meanwhile), each owner's own in
        order. The caller admits each sequence it takes before taking the next.

        Each pick walks the queue's owners' first sequences in order and stops at one whose
        owner runs nothing (none can beat it) or once every owner's is seen: a batch of
        single-sequence requests picks in O(1), whatever the queue's length."""
        if not self.fair_share:
            yield from list(self.waiting)
            return
        running = Counter(self.owner(s) for s in self.running)
        left: Counter | None = None  # per owner, the sequences not yet taken (counted on need)
        taken: set[int] = set()
        while len(taken) < len(self.waiting):
            best: tuple[int, Sequence] | None = None
            seen: set[str] = set()
            for s in self.waiting:
                who = self.owner(s)
                if id(s) in taken or who in seen:
                    continue
                seen.add(who)
                if best is None or running[who] < best[0]:
                    best = (running[who], s)  # on a tie the earlier first sequence wins
                if best[0] == 0:
                    break
                if left is None:
                    left = Counter(self.owner(w) for w in self.waiting if id(w) not in taken)
                if len(seen) == len(left):
                    break
            assert best is not None
            seq = best[1]
            who = self.owner(seq)
            taken.add(id(seq))
            running[who] += self._seq_slots(seq)
            if left is not None:
                left[who] -= 1
                if not left[who]:
                    del left[who]
            yield seq

    # --- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        self.running.sort(key=self.waiting_order_key)
        # Fair share (module docstring): room for a newly arrived owner, prompt tokens kept for
        # its first chunk, and echoed prompt logprobs in small chunks while others share.
        reserve, logprob_left, waiting_sorted = 0, self.token_budget, False
        if self.fair_share:
            if self.options.chunked_prefill:  # always: whoever arrives during a step waits for all of it
                logprob_left = PROMPT_LOGPROB_TOKENS
            if self.waiting and self.running:
                self.waiting.sort(key=self.waiting_order_key)
                waiting_sorted = True
                reserve = self._make_room_for_newcomer(out)
        fair_preemptions = len(out.preempted)
        prefill_left = self.prefill_allowance()

        def prefill_cap(seq: Sequence) -> int:
            if seq.request.params.prompt_logprobs is not None:
                return min(self.chunk_cap, logprob_left)
            return self.chunk_cap

        # 1. Running sequences first: decodes and prefill chunks in progress.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # A prompt in progress leaves `reserve` of the step to a newcomer's first chunk.
            room = min(prefill_cap(seq), prefill_left, budget - reserve) if seq.is_prefill else budget
            if room <= 0:
                i += 1  # its next chunk waits for a step with room
                continue
            want = seq.num_uncomputed_tokens + len(seq.draft_token_ids)
            n = min(want, budget, room)
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
            if seq.is_prefill:
                prefill_left -= n
                if seq.request.params.prompt_logprobs is not None:
                    logprob_left -= n
            i += 1

        # 2. Admit waiting sequences, unless this step had to preempt for room (none left).
        if len(out.preempted) == fair_preemptions:
            if not waiting_sorted or out.preempted:  # preempted sequences joined the queue's end
                self.waiting.sort(key=self.waiting_order_key)
            admitted: set[int] = set()
            for seq in self._admission_order():
                if min(budget, prefill_left) <= 0:
                    break
                if len(self.running) + self._seq_slots(seq) > self.max_num_seqs and self.running:
                    break
                if prefill_cap(seq) <= 0:
                    continue  # this step's prompt-logprob rows are spent; others may still fit
                if seq.num_computed_tokens == 0:
                    seq.num_computed_tokens = self.allocator.attach_cached_prefix(seq)
                want = seq.num_uncomputed_tokens
                n = min(want, budget, prefill_cap(seq), prefill_left)
                if (n < want and not self.options.chunked_prefill) or not self.allocator.can_allocate(seq, n):
                    break
                admitted.add(id(seq))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.blocks_to_copy += self.allocator.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                prefill_left -= n
                if seq.request.params.prompt_logprobs is not None:
                    logprob_left -= n
            if admitted:
                self.waiting = [s for s in self.waiting if id(s) not in admitted]
        return out


def build(options: ContinuousOptions, ctx: BuildContext) -> ContinuousScheduler:
    assert ctx.allocator is not None and ctx.limits is not None
    return ContinuousScheduler(options, ctx.allocator, ctx.limits, ctx.step_cost)


COMPONENT = Component(
    name="continuous",
    kind="scheduler",
    factory=build,
    options_type=ContinuousOptions,
    description="Continuous batching, FCFS, chunked prefill, preemption by recompute.",
    capabilities={"chunked_prefill": True, "preemption": "recompute", "devices": ("cpu", "cuda", "mps")},
)
