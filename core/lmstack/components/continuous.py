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
A chunk never drops below `MIN_PREFILL_TOKENS`, so new requests always progress. Unless every
decoding stream can take one more step past that pace within `long_gap_share` of its token gaps
(`_may_wait_long`): then the prompts take the whole budget, and the streams count the gap. At 8
closed-loop streams (2-core Zen 4) pacing the burst of each round's arrivals desynchronized the
streams, and 4-5 % of all gaps were paced ones (ITL P99 3.9-4.3x the median, 1.7-1.8x with it).

Nor when that pace would make a request wait past `ttft_target_ms` (1 s) for its first token
(a burst beside few decoding streams, ~20 prompt tokens a step, took seconds): the step then
carries the prompt tokens that let the pace finish every waiting interactive request within the
target of its arrival, in admission order, this step's own time counted; all of an overdue
request's (`_tokens_for_ttft`; measured: benchmarks/HISTORY.md, compare_servers' 2nd run). An
overloaded server then runs steps of the whole budget, each stalling every stream (ITL P99 15.7x
the median at 32 streams of a Q4_K_M file); `ttft_max_step_ratio` bounds them, at a price in
throughput and TTFT P99 (its option says what was measured), so it is off by default.

Order is by priority class, then FCFS (below); subclasses change it by overriding
`waiting_order_key` (the example priority plugin does), and everything else — budgets,
chunking, preemption, background work — comes along. Their order replaces the classes unless
they set `priority_classes = True`.

Fair share between requests (`fair_share`): one request (or one call's prompts, a
`Request.group`) may ask for hundreds of sequences, which FCFS would run before anything that
arrives later. Instead, waiting sequences are admitted round-robin across owners (fewest
running sequences first, then the order above), and a newly arrived owner with nothing running
gets its room at once: when the running slots (or KV blocks) are all taken, the newest sequences
of the owner holding the most are preempted, down to an equal share of `max_num_seqs` and no
further; prompts in progress leave room in the step for its first chunk. Echoed prompt logprobs,
the costliest prompt tokens, run at most `PROMPT_LOGPROB_TOKENS` a step. A small request waits
about a step for a slot, whatever runs.

Priority classes, aging and background work (priority >= `BATCH_PRIORITY`, the Batch API's):
`lmstack.components.priority_classes`, whose rules the scheduler mixes in.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from lmstack.components.continuous_options import ContinuousOptions
from lmstack.components.priority_classes import PriorityClasses
from lmstack.engine.step_cost import StepCostModel
from lmstack.interfaces import (
    BuildContext,
    EngineLimits,
    KVAllocator,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
)
from lmstack.registry import Component
from lmstack.sampling_params import BATCH_PRIORITY
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
# The tokens to come a stream's long-gap share counts (up to max_tokens): one that may stop at
# any token is credited only so many, or a max_tokens of thousands would spend it at once.
LONG_GAP_LOOKAHEAD = 128


class ContinuousScheduler(PriorityClasses, Scheduler):
    # Share slots between owners (module docstring); a subclass may turn it off.
    fair_share: bool = True
    # Priority classes (`lmstack.components.priority_classes`). None: on unless a subclass orders by its own
    # `waiting_order_key`, whose order then stays whole (one class, as before classes).
    priority_classes: bool | None = None

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
        # Aging reads the time once a step (`schedule`); tests replace the clock.
        self.clock: Callable[[], float] = time.monotonic
        self._now = 0.0
        # The prompt tokens this step's pace allows (`prefill_allowance`); past it: long gaps.
        self._paced: int | float = math.inf
        self._top = 0  # the most urgent base priority present this step
        self._interactive_seen = -math.inf  # when interactive work was last present (clock)
        self._priorities: Counter = Counter()  # base priority -> sequences waiting or running
        self._uniform = True  # one class this step: plain FCFS (or the subclass's order) + fair share
        self._classes = self.priority_classes
        if self._classes is None:
            self._classes = type(self).waiting_order_key is ContinuousScheduler.waiting_order_key

    # --- ordering (override in subclasses) -------------------------------------------------

    def waiting_order_key(self, seq: Sequence) -> tuple:
        """Lower is admitted first and preempted last: effective priority, then arrival time
        (FCFS), then id."""
        req = seq.request
        p = req.priority
        if p > self._top:  # only then can aging change it (inlined: sorted every step)
            p = self.effective_priority(seq)
        return (p, req.arrival_time, seq.seq_id)

    def _rank(self, seq: Sequence) -> tuple:
        """The most urgent class first, the subclass's order within it: the largest is
        preempted first."""
        return (self.effective_priority(seq), self.waiting_order_key(seq))

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
        self._priorities[seq.request.priority] += 1

    def finish(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                self._priorities[seq.request.priority] -= 1
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

    def _first_chunk(self, seq: Sequence) -> int:
        return min(seq.num_uncomputed_tokens, self.chunk_cap, self.token_budget)

    def _fits(self, seq: Sequence, tokens: int) -> bool:
        """Whether a waiting sequence has a running slot and KV room for `tokens`."""
        slots = len(self.running) + self._seq_slots(seq) <= self.max_num_seqs
        return slots and self.allocator.can_allocate(seq, tokens)

    def prefill_allowance(self, running: Iterable[Sequence] | None = None) -> int:
        """Prefill tokens this step may carry beside the running decodes of `running` (all
        running sequences by default; see the module docstring); the token budget when no
        stream decodes or nothing is measured yet."""
        decoding = [s for s in (self.running if running is None else running) if not s.is_prefill]
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
        decode_step = a + b * decodes

        def prompt_tokens(seconds: float) -> int:  # beside the decodes in a step of that time
            return int((seconds - a) / b) - decodes

        limits = []
        if o.max_step_ratio:
            limits.append(o.max_step_ratio * decode_step)
        if o.max_step_ms:
            limits.append(o.max_step_ms / 1000.0)
        tokens = max(MIN_PREFILL_TOKENS, min(prompt_tokens(min(limits)), self.token_budget))
        self._paced = tokens
        if o.long_gap_share and all(self._may_wait_long(s) for s in decoding if s.request.streamed):
            return self.token_budget
        if o.ttft_target_ms:
            catch_up = self._tokens_for_ttft(running, decode_step, b, tokens)
            if o.ttft_max_step_ratio:  # the rest of the backlog in the next steps
                catch_up = min(catch_up, prompt_tokens(o.ttft_max_step_ratio * decode_step))
            tokens = max(tokens, catch_up)
        return min(tokens, self.token_budget)

    def _may_wait_long(self, seq: Sequence) -> bool:
        """Whether one more long gap keeps a decoding stream's within `long_gap_share` of its
        token gaps, those so far and those to come (up to max_tokens, LONG_GAP_LOOKAHEAD at most)."""
        gaps, max_tokens = seq.num_output_tokens + LONG_GAP_LOOKAHEAD, seq.request.params.max_tokens
        gaps = gaps if max_tokens is None else min(gaps, max_tokens)
        return seq.long_gaps + 1 <= self.options.long_gap_share * gaps

    def _tokens_for_ttft(
        self, running: Iterable[Sequence] | None, t_decode: float, b: float, pace: int
    ) -> int:
        """The prompt tokens P this step must carry for every interactive request before its
        first token to get it within `ttft_target_ms` of its arrival, if later steps prefill
        `pace` tokens each (the max_step_ratio's, beside the decodes of t_decode seconds, at
        r tokens a second). In order (prompts in progress, then the waiting ones as admitted),
        the tokens T up to a request with L seconds left must be done by then, this step taking
        t_decode + b P of them: T - P <= r (L - t_decode - b P), so P >= (T - r (L - t_decode)) /
        (1 - r b). An overdue request needs all of its tokens and those before it."""
        target = self.options.ttft_target_ms / 1000.0
        rate = pace / (t_decode + b * pace)  # prompt tokens a second at that pace
        pending = [s for s in (self.running if running is None else running) if s.is_prefill]
        pending += [s for s in self.waiting if not self.is_background(s)]
        need, total = 0.0, 0
        for seq in pending:
            total += seq.num_uncomputed_tokens
            left = seq.arrival_time + target - self._now - t_decode
            need = max(need, total if left <= 0 else (total - rate * left) / (1.0 - rate * b))
        return math.ceil(need)

    def background_prefill_allowance(self) -> int | float:
        """With only background work: the prompt tokens that keep the step within
        `background_max_step_ms` beside the running decodes (at least MIN_PREFILL_TOKENS;
        unbounded when off or nothing is measured yet)."""
        bound = self.options.background_max_step_ms / 1000.0
        fit = self.step_cost.fit_near(self.token_budget) if bound and self.step_cost is not None else None
        if fit is None or fit[1] <= 0:
            return math.inf
        a, b = fit
        decodes = sum(1 + len(s.draft_token_ids) for s in self.running if not s.is_prefill)
        return max(MIN_PREFILL_TOKENS, int((bound - a) / b) - decodes)

    def _make_room_for_newcomer(self, out: SchedulerOutput) -> int:
        """Preempt the largest owner's newest sequences (never below an equal share of
        `max_num_seqs`) until the first waiting sequence of an owner with nothing running fits
        in slots and KV blocks. Returns the prompt tokens to keep for it in this step's budget
        (at most half the budget; 0 when nobody new waits or it cannot run yet). Needs
        `self.waiting` sorted by `waiting_order_key`.

        Only a newcomer of the most urgent waiting class counts, and only sequences of its
        class or a less urgent one are shared with it (one priority in play: everyone)."""
        top = self.effective_priority(self.waiting[0])
        running = Counter(self.owner(s) for s in self.running)
        seq = next(
            (
                s
                for s in self.waiting
                if self.owner(s) not in running and (self._uniform or self.effective_priority(s) == top)
            ),
            None,
        )
        if seq is None:
            return 0
        first_chunk = self._first_chunk(seq)
        if self._fits(seq, first_chunk):
            return min(first_chunk, self.token_budget // 2)
        pool = [s for s in self.running if self._uniform or self.effective_priority(s) >= top]
        running = Counter(self.owner(s) for s in pool)
        if not running or running.most_common(1)[0][1] <= 1:
            return 0  # nobody holds more than one slot: nothing to share (a batch of prompts)
        waiting_owners = {
            self.owner(s) for s in self.waiting if self._uniform or self.effective_priority(s) == top
        }
        owners = len(set(running) | waiting_owners)
        share = max(1, self.max_num_seqs // owners)
        if self._seq_slots(seq) > share:
            return 0  # it would hold more than a share itself: the next newcomer would take it back
        while self.running and not self._fits(seq, first_chunk):
            hog, held = running.most_common(1)[0]
            if held <= share:
                return 0  # every owner is within its share: the newcomer waits its turn
            victim = max((s for s in pool if self.owner(s) == hog), key=self.waiting_order_key)
            self._preempt(victim, out)
            pool.remove(victim)
            running[hog] -= 1
        return min(first_chunk, self.token_budget // 2)

    def _admission_order(self, queue: list[Sequence] | None = None) -> Iterator[Sequence]:
        """Sequences of `queue` (default `self.waiting`, sorted by `waiting_order_key`) in the
        order to admit them: class by class (effective priority), and with `fair_share`
        round-robin across owners within a class. The caller admits each sequence it takes
        before taking the next."""
        queue = self.waiting if queue is None else queue
        if not self.fair_share:
            yield from list(queue)
            return
        running = Counter(self.owner(s) for s in self.running)
        classes: dict[int, list[Sequence]] = {0: queue}  # one class: the queue itself
        if not self._uniform:
            classes = {}
            for s in queue:
                classes.setdefault(self.effective_priority(s), []).append(s)
        for urgency in sorted(classes):
            yield from self._round_robin(classes[urgency], running)

    def _round_robin(self, queue: list[Sequence], running: Counter) -> Iterator[Sequence]:
        """Round-robin across owners: the owner with the fewest running sequences next
        (`running`, counting those admitted meanwhile), each owner's own in queue order.

        Each pick walks the queue's owners' first sequences in order and stops at one whose
        owner runs nothing (none can beat it) or once every owner's is seen: a batch of
        single-sequence requests picks in O(1), whatever the queue's length."""
        left: Counter | None = None  # per owner, the sequences not yet taken (counted on need)
        taken: set[int] = set()
        while len(taken) < len(queue):
            best: tuple[int, Sequence] | None = None
            seen: set[str] = set()
            for s in queue:
                who = self.owner(s)
                if id(s) in taken or who in seen:
                    continue
                seen.add(who)
                if best is None or running[who] < best[0]:
                    best = (running[who], s)  # on a tie the earlier first sequence wins
                if best[0] == 0:
                    break
                if left is None:
                    left = Counter(self.owner(w) for w in queue if id(w) not in taken)
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
        self._now = self.clock()
        self._paced = math.inf
        lo, hi = self._priority_range()
        self._top, self._uniform = lo, lo == hi or not self._classes
        # Background rules (`priority_classes`) apply only with interactive work present;
        # otherwise background is scheduled like any traffic.
        if lo < BATCH_PRIORITY:
            self._interactive_seen = self._now
        recent = self._now - self._interactive_seen < self.options.background_grace_s
        mixed = hi >= BATCH_PRIORITY and (lo < BATCH_PRIORITY or recent)
        self.running.sort(key=self.waiting_order_key)
        # Priority and fair share: room for the most urgent waiting sequence and for a newly
        # arrived owner, prompt tokens kept for its first chunk, and echoed prompt logprobs in
        # small chunks while others share.
        reserve, urgent_reserve, urgent = 0, 0, None
        logprob_left, waiting_sorted = self.token_budget, False
        if self.fair_share and self.options.chunked_prefill:
            # Always: whoever arrives during a step waits for all of it.
            logprob_left = PROMPT_LOGPROB_TOKENS
        if self.waiting and self.running:
            self.waiting.sort(key=self.waiting_order_key)
            waiting_sorted = True
            if not self._uniform:
                self._preempt_for_priority(out)
                urgent = self.effective_priority(self.waiting[0])
                urgent_reserve = min(self._first_chunk(self.waiting[0]), self.token_budget // 2)
            if self.fair_share:
                reserve = self._make_room_for_newcomer(out)
        room_preemptions = len(out.preempted)
        interactive = [s for s in self.running if not self.is_background(s)] if mixed else self.running
        prefill_left = self.prefill_allowance(interactive)
        if lo >= BATCH_PRIORITY and not mixed:
            prefill_left = min(prefill_left, self.background_prefill_allowance())

        def prefill_cap(seq: Sequence) -> int:
            if seq.request.params.prompt_logprobs is not None:
                return min(self.chunk_cap, logprob_left)
            return self.chunk_cap

        def run(seq: Sequence, limit: int | float) -> bool:
            """Schedule a running sequence's next tokens (at most `limit`); False when it, or
            the sequence it is compared with, had to be preempted for blocks (stop the pass)."""
            nonlocal budget, prefill_left, logprob_left
            # A prompt in progress leaves `reserve` of the step to a newcomer's first chunk,
            # and the same to a more urgent waiting sequence's.
            if seq.is_prefill:
                keep = reserve
                if urgent is not None and urgent < self.effective_priority(seq):
                    keep = max(keep, urgent_reserve)
                room = min(prefill_cap(seq), prefill_left, budget - keep, limit)
            else:
                room = min(budget, limit)
            if room <= 0:
                return True  # its next chunk waits for a step with room
            want = seq.num_uncomputed_tokens + len(seq.draft_token_ids)
            n = min(want, budget, room)
            if n < want and seq.draft_token_ids:
                seq.draft_token_ids = []  # no room to verify drafts this step
                n = min(seq.num_uncomputed_tokens, budget)
            # Out of blocks: preempt the lowest-ranked running sequence (maybe this one). The
            # running list is sorted, except for the interactive sequences admitted this step
            # (at its end) when background sequences run after them.
            while not self.allocator.can_allocate(seq, n):
                victim = self.running[-1] if self._uniform else max(self.running, key=self._rank)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                return False
            out.blocks_to_copy += self.allocator.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if seq.is_prefill:
                prefill_left -= n
                if seq.request.params.prompt_logprobs is not None:
                    logprob_left -= n
            return True

        admitted: set[int] = set()

        def admit(queue: list[Sequence], limit: int | float) -> int:
            """Admit waiting sequences of `queue` in `_admission_order`, their first chunks
            taking at most `limit` tokens in all; returns the tokens admitted."""
            nonlocal budget, prefill_left, logprob_left
            spent = 0
            for seq in self._admission_order(queue):
                if min(budget, prefill_left, limit - spent) <= 0:
                    break
                if len(self.running) + self._seq_slots(seq) > self.max_num_seqs and self.running:
                    break
                if prefill_cap(seq) <= 0:
                    continue  # this step's prompt-logprob rows are spent; others may still fit
                if seq.num_computed_tokens == 0:
                    seq.num_computed_tokens = self.allocator.attach_cached_prefix(seq)
                want = seq.num_uncomputed_tokens
                n = min(want, budget, prefill_cap(seq), prefill_left, limit - spent)
                if (n < want and not self.options.chunked_prefill) or not self.allocator.can_allocate(seq, n):
                    break
                admitted.add(id(seq))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.blocks_to_copy += self.allocator.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                prefill_left -= n
                spent += n
                if seq.request.params.prompt_logprobs is not None:
                    logprob_left -= n
            return spent

        # 1. Running sequences first: decodes and prefill chunks in progress (with background
        # work beside interactive work: the interactive ones here, the background ones in 3).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not mixed or not self.is_background(seq):
                if not run(seq, math.inf):
                    break
            i += 1

        # 2. Admit waiting sequences, unless this step had to preempt for room (none left).
        if len(out.preempted) == room_preemptions:
            if not waiting_sorted or out.preempted:  # preempted sequences joined the queue's end
                self.waiting.sort(key=self.waiting_order_key)
            if mixed:
                admit([s for s in self.waiting if not self.is_background(s)], math.inf)
            else:
                admit(self.waiting, math.inf)

        # 3. Background work beside interactive work: the tokens the slack leaves (b), no prompt
        # chunk while an interactive sequence waits or is in its prompt (a).
        if mixed and budget > 0:
            left = self.background_allowance(sum(it.num_tokens for it in out.scheduled))
            prompts_ok = not any(
                not self.is_background(s) and (s.is_prefill or s.status is not SequenceStatus.RUNNING)
                for s in (*self.running, *self.waiting)
            )
            for seq in [s for s in self.running if self.is_background(s)]:
                if budget <= 0 or left <= 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or (seq.is_prefill and not prompts_ok):
                    continue  # preempted meanwhile, or its prompt waits for the interactive ones
                before = budget
                if not run(seq, left):
                    break
                left -= before - budget
            if prompts_ok and left > 0 and len(out.preempted) == room_preemptions:
                admit([s for s in self.waiting if self.is_background(s) and id(s) not in admitted], left)
        if admitted:
            self.waiting = [s for s in self.waiting if id(s) not in admitted]
        if sum(it.num_tokens for it in out.scheduled if it.seq.is_prefill) > self._paced:
            for it in out.scheduled:  # the decodes waited through a step past the pace
                if not it.seq.is_prefill:
                    it.seq.long_gaps += 1
        return out


def build(options: ContinuousOptions, ctx: BuildContext) -> ContinuousScheduler:
    assert ctx.allocator is not None and ctx.limits is not None
    return ContinuousScheduler(options, ctx.allocator, ctx.limits, ctx.step_cost)


COMPONENT = Component(
    name="continuous",
    kind="scheduler",
    factory=build,
    options_type=ContinuousOptions,
    description="Continuous batching by priority class (FCFS and fair share within one), chunked prefill, "
    "preemption by recompute, background work (priority >= 100) in the capacity interactive work leaves.",
    capabilities={"chunked_prefill": True, "preemption": "recompute", "devices": ("cpu", "cuda", "mps")},
)
