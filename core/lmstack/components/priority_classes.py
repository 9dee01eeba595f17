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
interactive work (priority below it) leaves. With the defaults (slack 0) it runs only once no
interactive work has been present for `background_grace_s`, in steps bounded by
`background_max_step_ms`, and waits, paused with its KV, while interactive work runs: on a CPU a
step is compute-bound from a few dozen tokens, so any background token beside interactive ones
lengthens their step. In full:
(a) no background prompt chunk shares a step with an interactive sequence that waits or is in
    its prompt; (b) while interactive work is present, background sequences take only the
    tokens that keep the step's predicted time (`step_cost`, t(T) = a + b * T) within
    (1 + `background_slack`) x the interactive-only step: t(T_int + T_bg) on the measured
    curve, and T_bg <= slack * t(T_int) / b with b a decode step's slope
    (`background_allowance`); with slack 0 or without a measured cost model, none (in the
    grace the scheduler then returns an empty step, and the engine loop waits a moment,
    `lmstack.engine.async_engine.HELD_BACK_WAIT_S`, instead of spinning). Background sequences
    past that are paused for the step (oldest run first) and keep their KV; they are preempted,
    newest first, when an interactive sequence needs their slot or blocks; (c) with no
    interactive work for `background_grace_s`, background is scheduled like any traffic (the
    full batch), except that a step carrying its prompt chunks is predicted to take at most
    `background_max_step_ms` (an interactive request arriving meanwhile waits for the step
    under way). Within the grace, (b) holds with no interactive tokens: a closed-loop client's
    next request arrives a moment after its last one ends.
"""

from __future__ import annotations

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
    token_budget: int
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
        step. None measured yet, or slack 0: 0.

        Two bounds, the smaller wins. (1) The measured cost curve itself (`StepCostModel.
        fit_near`, piecewise through the measured sizes): t(T_int + T_bg) <= (1 + slack) x
        t(T_int). A line through the sizes around the step alone is not enough: small steps are
        memory-bound, so that line is nearly flat (exactly flat where noise made a larger size
        measure faster and the model pooled them), and slack x t / slope then allowed up to the
        whole token budget of background prompts (~1 s a step on 2 cores), in the grace too, just
        when a closed-loop client's next requests arrive: they wait for all of that step.
        (2) Each background token priced at the slope around a decode step of every running
        sequence: a decode token (attention over its context, sampling) costs several times a
        long prompt's, so the curve around a prompt step would let too many ride along."""
        slack = self.options.background_slack
        if self.step_cost is None or slack <= 0:
            return 0
        near = self.step_cost.fit_near(interactive_tokens)
        decode = self.step_cost.fit_near(max(1, len(self.running)))
        if near is None or decode is None:
            return 0
        a, b = near
        base = a + b * interactive_tokens
        target = (1 + slack) * base * (1 + 1e-9)  # the tolerance: float rounding, not time
        allowed = self._tokens_within(interactive_tokens, target, self.token_budget)
        if decode[1] > 0:
            allowed = min(allowed, int(slack * base / decode[1]))
        return allowed

    def _tokens_within(self, start: int, seconds: float, most: int) -> int:
        """The most tokens (up to `most`) that a step of `start` tokens may add with the measured
        curve predicting at most `seconds` for it (bisection: the curve never falls)."""
        assert self.step_cost is not None

        def fits(extra: int) -> bool:
            a, b = self.step_cost.fit_near(start + extra)  # type: ignore[misc]
            return a + b * (start + extra) <= seconds

        if fits(most):
            return most
        lo, hi = 0, most  # fits(lo) or lo == 0; not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

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
