"""The priority rules `continuous` (`lmstack.components.continuous`) mixes in.

Priority classes (`Request.priority`, lower runs first): waiting sequences are admitted class
by class, fair share and FCFS within a class. When the most urgent waiting sequence has no slot
or no KV room for its first chunk, the least urgent running sequences of a less urgent class are
preempted (newest first, by recompute; a tiered KV cache keeps their blocks through its normal
free path), and prompts of a less urgent class in progress leave its first chunk room in the
step. With one priority in play (all 0) the order and every step are plain FCFS + fair share.

Aging bounds starvation: a sequence's effective priority improves by one per
`priority_aging_s` seconds since it arrived, down to the most urgent priority among the
sequences present (waiting or running), where it is served by the fair share and FCFS like the
rest. So a request at priority p waits at most (p - p_top) x `priority_aging_s` before it
competes on arrival order with the most urgent class p_top. Background sequences (below) age
among themselves but never below `BATCH_PRIORITY`: they stay background. 0 disables aging.

Background work (priority >= `BATCH_PRIORITY`, the Batch API's) fills only the capacity that
interactive work (priority below it) leaves:
(a) no background prompt chunk shares a step with an interactive sequence that waits or is in
    its prompt; (b) while interactive work is present, background sequences take only the
    tokens that keep the step's predicted time (`step_cost`, t(T) = a + b * T) within
    (1 + `background_slack`) x the interactive-only step: T_bg <= slack * t(T_int) / b, where
    t is the measured line around T_int and b the steeper of its slope and a decode step's
    (`background_allowance`); without a measured cost model, none. Background sequences past
    that are paused for the step (oldest run first) and keep their KV; they are preempted,
    newest first, when an interactive sequence needs their slot or blocks; (c) with no
    interactive work for `background_grace_s`, background is scheduled like any traffic (the
    full batch), except that a step carrying its prompt chunks is predicted to take at most
    `background_max_step_ms` (an interactive request arriving meanwhile waits for the step
    under way). Within the grace, (b) holds with no interactive tokens: a closed-loop client's
    next request arrives a moment after its last one ends.
"""

from __future__ import annotations

import math
from collections import Counter

from lmstack.components.continuous_options import ContinuousOptions
from lmstack.engine.step_cost import StepCostModel
from lmstack.interfaces import KVAllocator, SchedulerOutput
from lmstack.sampling_params import BATCH_PRIORITY
from lmstack.sequence import Sequence


class PriorityClasses:
    """Effective priorities (aging), the background budget and preemption for a more urgent
    class, over the scheduler's queues; `ContinuousScheduler` sets the state below each step
    and provides `_first_chunk`, `_seq_slots`, `_rank` and `_preempt`."""

    options: ContinuousOptions
    allocator: KVAllocator
    step_cost: StepCostModel | None
    waiting: list[Sequence]
    running: list[Sequence]
    max_num_seqs: int
    _now: float  # this step's clock
    _top: int  # the most urgent base priority present this step
    _priorities: Counter  # base priority -> sequences waiting or running

    def effective_priority(self, seq: Sequence) -> int:
        """The request's priority, improved by aging (module docstring) as of this step."""
        p = seq.request.priority
        aging = self.options.priority_aging_s
        if aging <= 0 or p <= self._top:
            return p
        floor = max(self._top, BATCH_PRIORITY) if p >= BATCH_PRIORITY else self._top
        steps = int(max(0.0, self._now - seq.arrival_time) // aging)
        return max(p - steps, floor)

    @staticmethod
    def is_background(seq: Sequence) -> bool:
        return seq.request.priority >= BATCH_PRIORITY

    def _priority_range(self) -> tuple[int, int]:
        """(most, least urgent) base priority among the sequences present; (0, 0) for none.
        Counted as sequences come and go (a scan of a long queue each step costs ~1 ms); counted
        again should the queues have been changed behind `add` and `finish`."""
        counts = self._priorities
        if counts.total() != len(self.waiting) + len(self.running):
            counts.clear()
            counts.update(s.request.priority for q in (self.waiting, self.running) for s in q)
        present = [p for p, n in counts.items() if n > 0]
        return (min(present), max(present)) if present else (0, 0)

    def background_allowance(self, interactive_tokens: int) -> int | float:
        """Background tokens a step of `interactive_tokens` interactive tokens may carry: the
        most that keep its predicted time within (1 + background_slack) x the interactive-only
        step. None measured yet: 0; tokens measured free: unbounded.

        t(T_int) comes from the line through the measured sizes around the step
        (`StepCostModel.fit_near`); a background token is priced at the steeper of that line's
        slope and the slope around a decode step of every running sequence: a decode token
        (attention over its context, sampling) costs several times a long prompt's, so a
        prompt step's slope alone would let too many background decodes ride along."""
        if self.step_cost is None:
            return 0
        near = self.step_cost.fit_near(interactive_tokens)
        decode = self.step_cost.fit_near(max(1, len(self.running)))
        if near is None or decode is None:
            return 0
        a, b = near
        per_token = max(b, decode[1])
        if per_token <= 0:
            return math.inf
        return int(self.options.background_slack * (a + b * interactive_tokens) / per_token)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Preempt the least urgent running sequences (newest first) while sequences more
        urgent than them wait without a slot, or the first of those without KV room for its
        first chunk. Needs `self.waiting` sorted by `waiting_order_key`."""
        first = self.waiting[0]
        first_chunk = self._first_chunk(first)
        while self.running:
            victim = max(self.running, key=self._rank)
            worst = self.effective_priority(victim)
            slots = 0
            for seq in self.waiting:  # the waiting sequences more urgent than the victim
                if self.effective_priority(seq) >= worst:
                    break
                slots += self._seq_slots(seq)
            if not slots:
                return  # nothing less urgent than the waiting runs: they wait their turn
            if len(self.running) + slots <= self.max_num_seqs and self.allocator.can_allocate(
                first, first_chunk
            ):
                return
            self._preempt(victim, out)
