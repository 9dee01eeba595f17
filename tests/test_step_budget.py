"""Prefill that does not starve decode: the measured step cost and the `continuous` scheduler's
step-time target (`max_step_ratio`, `max_step_ms`)."""

from __future__ import annotations

import math
import random

import pytest

from lmstack.components.continuous import (
    LONG_GAP_LOOKAHEAD,
    MIN_PREFILL_TOKENS,
    ContinuousOptions,
    ContinuousScheduler,
)
from lmstack.engine.step_cost import StepCostModel
from lmstack.errors import ConfigError
from lmstack.interfaces import EngineLimits
from lmstack.testing.components import build_component
from lmstack.testing.fakes import make_seq
from lmstack.testing.scheduler import simulate

A, B = 0.05, 0.001  # 50 ms a step plus 1 ms a query token: a CPU-like, compute-heavy cost


def fitted(a: float = A, b: float = B) -> StepCostModel:
    cost = StepCostModel()
    for t in (1, 4, 32, 256):
        cost.record(t, 7 * (a + b * t))  # a warm-up outlier: replaced by the next sample
        cost.record(t, a + b * t)
    return cost


def test_cost_model_fits_after_warm_up_and_not_before():
    cost = StepCostModel()
    assert cost.fit() is None and cost.tokens_within(1.0) is None
    cost.record(1, 0.5)
    cost.record(64, 0.5)
    assert cost.fit() is None, "first samples of a size are warm-up"
    a, b = fitted().fit()
    assert a == pytest.approx(A) and b == pytest.approx(B)
    assert fitted().tokens_within(A + 100 * B + 1e-9) == 100
    assert fitted().predict(10) == pytest.approx(A + 10 * B)


def priced(cost: StepCostModel, num_tokens: int) -> float:
    """t(num_tokens) by the line through the measured sizes around it (`fit_near`)."""
    a, b = cost.fit_near(num_tokens)
    return a + b * num_tokens


def test_a_range_of_sizes_is_priced_as_the_local_lines_price_each():
    """`seconds_from` (the draft policy's every-prefix pricing) against `fit_near` size by size, on
    kinked costs measured at uneven sizes (bucket means need not be whole numbers)."""
    rng = random.Random(7)
    for _ in range(50):
        cost = StepCostModel()
        for t in sorted(rng.sample(range(1, 300), rng.randint(2, 7))):
            for _ in range(rng.randint(2, 4)):
                cost.record(t + rng.randint(0, t // 2), rng.uniform(0.001, 0.002) + 0.0004 * t * rng.random())
        start, count = rng.randint(0, 200), rng.randint(1, 300)
        got = cost.seconds_from(start, count)
        if cost.fit_near(start) is None:
            assert got is None
            continue
        want = [priced(cost, t) for t in range(start, start + count)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert StepCostModel().seconds_from(1, 4) is None


def test_a_step_of_more_tokens_is_never_priced_cheaper():
    """As measured at 32 streams on a CPU: 24-token steps (a batch's tail, a busier moment) at
    15.7 ms, the 32-token bucket's mean (drafts riding along) at 32.9 tokens and 15.4 ms. The
    local lines once clamped the falling segment flat at its low end: t(32) = 15.7 ms, then
    15.4 ms from 33 up: a draft row worth less than nothing. Pooled, the curve never falls, on
    these and on random noisy measurements."""
    cost = StepCostModel()
    for t, seconds in ((2, 0.0047), (24, 0.0157), (33, 0.0154), (64, 0.0232)):
        cost.record(t, seconds)
        cost.record(t, seconds)
    t = {n: priced(cost, n) for n in (24, 32, 33, 34)}
    assert t[34] >= t[33] >= t[32] >= t[24] - 1e-12
    assert t[32] == pytest.approx((0.0157 + 0.0154) / 2)
    rng = random.Random(3)
    for _ in range(50):
        noisy = StepCostModel()
        for t in sorted(rng.sample(range(1, 200), rng.randint(2, 7))):
            noisy.record(t, 0.01)
            noisy.record(t, rng.uniform(0.01, 0.02) + 0.0001 * t)
        times = noisy.seconds_from(0, 256)
        if times is None:  # the sizes fell in one bucket
            continue
        assert all(b >= a - 1e-15 for a, b in zip(times, times[1:]))


def scheduler(cost: StepCostModel | None, **options) -> ContinuousScheduler:
    limits = EngineLimits(max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048)
    alloc = build_component("paged", "allocator", {"num_blocks": 2048, "block_size": 16})
    # The step ratio alone unless a test asks for the TTFT target (its own tests below).
    options.setdefault("ttft_target_ms", 0)
    opts = ContinuousOptions(max_num_seqs=64, max_num_batched_tokens=2048, **options)
    return ContinuousScheduler(opts, alloc, limits, cost)


def decoding(sched: ContinuousScheduler, count: int, streamed: bool = True, max_tokens: int = 100) -> list:
    """`count` sequences admitted and past their prompts (the next step decodes them)."""
    seqs = [make_seq(5, max_tokens, streamed=streamed) for _ in range(count)]
    for s in seqs:
        sched.add(s)
    while any(s.is_prefill for s in seqs):
        for it in sched.schedule().scheduled:
            it.seq.num_computed_tokens += it.num_tokens
            if it.seq.num_computed_tokens == it.seq.num_tokens:
                it.seq.token_ids.append(7)
    return seqs


def prompt_tokens_beside(sched: ContinuousScheduler, prompt_len: int = 1500) -> tuple[int, int]:
    """(decode tokens, tokens given to a new long prompt) in the next step."""
    long = make_seq(prompt_len, 4)
    sched.add(long)
    out = sched.schedule()
    by_id = {it.seq.seq_id: it.num_tokens for it in out.scheduled}
    return out.num_batched_tokens - by_id.get(long.seq_id, 0), by_id.get(long.seq_id, 0)


@pytest.mark.parametrize("num_decodes", [1, 8, 32])
def test_prefill_beside_decodes_is_sized_to_the_step_ratio(num_decodes):
    sched = scheduler(fitted(), max_step_ratio=2.5)
    decoding(sched, num_decodes)
    decodes, chunk = prompt_tokens_beside(sched)
    assert decodes == num_decodes, "every running decode keeps going"
    expected = int((2.5 * (A + B * num_decodes) - A) / B) - num_decodes
    assert chunk == max(MIN_PREFILL_TOKENS, expected)
    # The step is predicted within the target: the gap between a stream's tokens is bounded.
    assert A + B * (decodes + chunk) <= 2.5 * (A + B * decodes) + 1e-9


def test_absolute_target_and_the_floor():
    sched = scheduler(fitted(), max_step_ratio=0, max_step_ms=150)
    decoding(sched, 4)
    assert prompt_tokens_beside(sched)[1] == int((0.150 - A) / B) - 4
    sched = scheduler(fitted(), max_step_ratio=0, max_step_ms=51)  # room for ~1 token: the floor
    decoding(sched, 4)
    assert prompt_tokens_beside(sched)[1] == MIN_PREFILL_TOKENS


@pytest.mark.parametrize(
    "cost, options, decodes",
    [
        (fitted(), {}, 0),  # nothing decodes: prompts get the whole budget
        (StepCostModel(), {}, 4),  # nothing measured yet
        (None, {}, 4),  # built without a cost model
        (fitted(), {"max_step_ratio": 0}, 4),  # switched off
        (fitted(b=0.0), {}, 4),  # tokens measured free (memory-bound): no reason to hold back
    ],
)
def test_whole_budget_when_time_is_not_at_stake(cost, options, decodes):
    sched = scheduler(cost, **options)
    decoding(sched, decodes)
    assert prompt_tokens_beside(sched, prompt_len=3000)[1] == 2048 - decodes


def test_prompts_beside_requests_read_whole_take_the_budget_until_one_streams():
    """Decodes whose callers read them only when they end (`Request.streamed` False: offline
    batches, non-streaming HTTP calls) do not hold prompts back: fewer, fuller steps finish
    every one of them sooner. One streamed decode among them brings the step target back."""
    sched = scheduler(fitted(), max_step_ratio=2.5)
    decoding(sched, 8, streamed=False)
    assert prompt_tokens_beside(sched, prompt_len=3000)[1] == 2048 - 8
    sched = scheduler(fitted(), max_step_ratio=2.5)
    decoding(sched, 7, streamed=False)
    decoding(sched, 1, streamed=True)
    expected = int((2.5 * (A + B * 8) - A) / B) - 8
    assert prompt_tokens_beside(sched, prompt_len=3000)[1] == expected < 2048 - 8


def test_without_chunked_prefill_prompts_are_never_sized():
    sched = scheduler(fitted(), chunked_prefill=False)
    decoding(sched, 8)
    assert prompt_tokens_beside(sched, prompt_len=1000)[1] == 1000


def test_every_request_finishes_and_every_mixed_step_keeps_to_the_target():
    """Arrivals while others decode: the run completes (no prompt starves) and no step that
    carried decodes exceeded the predicted target by more than the floor allows."""
    cost = fitted()
    limits = EngineLimits(max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048)
    alloc = build_component("paged", "allocator", {"num_blocks": 2048, "block_size": 16})
    sched = ContinuousScheduler(ContinuousOptions(ttft_target_ms=0), alloc, limits, cost)
    worst: list[float] = []
    original = sched.schedule

    def watched():
        decodes = sum(1 + len(s.draft_token_ids) for s in sched.running if not s.is_prefill)
        out = original()
        if decodes and out.num_batched_tokens > decodes:
            target = max(2.5 * (A + B * decodes), A + B * (decodes + MIN_PREFILL_TOKENS))
            worst.append((A + B * out.num_batched_tokens) / target)
        return out

    sched.schedule = watched
    first = [make_seq(300, 40) for _ in range(6)]
    late = {step: [make_seq(700, 5)] for step in range(3, 60, 7)}
    done = simulate(sched, alloc, first, limits=limits, arrivals=late)
    assert len(done) == len(first) + len(late)
    assert worst and max(worst) <= 1.0 + 1e-9


def test_a_burst_runs_at_once_when_every_stream_can_afford_one_long_gap():
    """Streams of 128 tokens may take one gap in 128 past the pace (long_gap_share 0.008, under
    1 %: ITL P99 keeps to the pace): the first prompt beside them gets the whole budget and
    each stream counts the gap; the next is paced; a stream of 100 tokens (1 gap would be 1 %)
    or the option at 0 keeps every step to the pace."""
    sched = scheduler(fitted(), max_step_ratio=2.5)
    streams = decoding(sched, 4, max_tokens=128)
    paced = int((2.5 * (A + B * 4) - A) / B) - 4
    assert prompt_tokens_beside(sched, prompt_len=3000)[1] == 2048 - 4 > paced
    assert [s.long_gaps for s in streams] == [1, 1, 1, 1]
    for it in sched.schedule().scheduled:  # the prompt's next chunk: paced now
        assert it.seq.long_gaps == (1 if it.seq in streams else 0)
    assert sched.schedule().num_batched_tokens == 4 + paced
    for options, max_tokens in (({}, 100), ({"long_gap_share": 0}, 128)):
        sched = scheduler(fitted(), **options)
        streams = decoding(sched, 4, max_tokens=max_tokens)
        assert prompt_tokens_beside(sched, prompt_len=3000)[1] == paced
        assert [s.long_gaps for s in streams] == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match="long_gap_share"):
        ContinuousOptions(long_gap_share=1)


def test_a_long_stream_earns_a_long_gap_per_share_of_its_tokens():
    """Without max_tokens a stream is credited LONG_GAP_LOOKAHEAD tokens to come: its first long
    gap at once, the next when its gaps so far and to come make 2 / 0.008 = 250; one stream
    without that share keeps the step to the pace for all."""
    sched = scheduler(fitted(), max_step_ratio=2.5)
    (long, other) = decoding(sched, 2, max_tokens=100)
    long.request.params.max_tokens = other.request.params.max_tokens = None
    long.long_gaps = 1
    assert not sched._may_wait_long(long) and sched._may_wait_long(other)
    long.token_ids += [7] * (250 - LONG_GAP_LOOKAHEAD - long.num_output_tokens - 1)
    long.num_computed_tokens = long.num_tokens - 1  # decoded them
    assert not sched._may_wait_long(long)
    paced = prompt_tokens_beside(sched, prompt_len=3000)[1]
    assert paced == int((2.5 * (A + B * 2) - A) / B) - 2
    long.token_ids.append(7)
    long.num_computed_tokens = long.num_tokens - 1
    assert sched._may_wait_long(long)
    assert sched.schedule().num_batched_tokens == 2048  # the prompt's next chunk: all the rest
    assert (long.long_gaps, other.long_gaps) == (2, 1)


def test_option_values_are_checked():
    with pytest.raises(ConfigError, match="max_step_ratio"):
        ContinuousOptions(max_step_ratio=0.5)
    with pytest.raises(ConfigError, match="max_step_ms"):
        ContinuousOptions(max_step_ms=-1)
    with pytest.raises(ConfigError, match="ttft_target_ms"):
        ContinuousOptions(ttft_target_ms=-1)


NOW = 500.0
# Beside one decode the step ratio lets 76 prompt tokens into a 0.127 s step (fitted()).
PACE = int((2.5 * (A + B) - A) / B) - 1
RATE = PACE / (A + B * (1 + PACE))  # prompt tokens a second at that pace: ~598


def prompt_tokens_with(prompts: list, target_ms: float = 1000.0, cap: float = 0) -> int:
    """Prompt tokens of the next step beside one decoding stream, with `prompts` waiting, on a
    clock stopped at NOW (`cap`: ttft_max_step_ratio; off unless a test asks for it)."""
    sched = scheduler(fitted(), ttft_target_ms=target_ms, ttft_max_step_ratio=cap)
    sched.clock = lambda: NOW
    (stream,) = decoding(sched, 1)
    for p in prompts:
        sched.add(p)
    out = sched.schedule()
    assert any(it.seq is stream and it.num_tokens == 1 for it in out.scheduled), "the stream decodes"
    return out.num_batched_tokens - 1


def test_a_burst_the_ratio_cannot_clear_in_time_gets_what_keeps_the_ttft_target():
    """Two fresh 400-token prompts beside one stream (the step's decode: 51 ms; 1 ms a prompt
    token): at the ratio's pace (~598 prompt tokens a second) the second would wait ~1.4 s, so
    this step carries the P tokens after which the pace still finishes it within 1 s of its
    arrival, this step's own time included: 800 - P = 598 (1 - 0.051 - 0.001 P); the ratio alone
    would give 76. Checked by playing the plan out."""
    assert PACE == 76
    p = prompt_tokens_with([make_seq(400, 4, arrival=NOW) for _ in range(2)])
    assert p == math.ceil((800 - RATE * (1.0 - A - B)) / (1 - RATE * B))
    this_step = A + B * (1 + p)
    assert this_step + (800 - p) / RATE <= 1.0 + 1e-9 < this_step + (800 - p + 1) / RATE
    assert PACE < p < 800
    assert prompt_tokens_with([make_seq(400, 4, arrival=NOW) for _ in range(2)], target_ms=0) == PACE
    # Past what even the whole budget can do in time: all of the backlog now (within the budget).
    assert prompt_tokens_with([make_seq(500, 4, arrival=NOW) for _ in range(3)]) == 1500


def test_a_request_past_its_target_gets_all_of_its_prompt_and_the_rest_keep_the_pace():
    """The first prompt arrived 1.5 s ago (past a 1 s target): all of it runs now; the second,
    fresh and short, may wait for the pace, so the step is the first's 700."""
    late = make_seq(700, 4, arrival=NOW - 1.5)
    fresh = make_seq(60, 4, arrival=NOW)
    assert prompt_tokens_with([late, fresh]) == 700


def test_catch_up_steps_are_bounded_by_their_own_ratio():
    """With `ttft_max_step_ratio` 4 a catch-up step is predicted to take at most 4x the
    decode-only step (beside one stream: 4 * 51 ms, 153 prompt tokens); what it leaves goes to
    the next steps. A backlog the bound already covers is unchanged, as is the ratio's pace."""
    capped = int((4 * (A + B) - A) / B) - 1
    assert capped == 153
    late = [make_seq(500, 4, arrival=NOW - 1.5) for _ in range(3)]
    assert prompt_tokens_with(late, cap=4) == capped
    assert prompt_tokens_with(late) == 1500  # off: the whole budget
    burst = [make_seq(400, 4, arrival=NOW) for _ in range(2)]
    assert prompt_tokens_with(burst, cap=4) == capped < prompt_tokens_with(burst)
    assert prompt_tokens_with(burst, cap=20) == prompt_tokens_with(burst)
    assert prompt_tokens_with([make_seq(300, 4, arrival=NOW)], cap=4) == PACE
    with pytest.raises(ConfigError, match="ttft_max_step_ratio"):
        ContinuousOptions(ttft_max_step_ratio=0.5)
    assert ContinuousOptions().ttft_max_step_ratio == 0  # off by default (its option says why)


def test_a_backlog_the_pace_clears_in_time_keeps_the_ratio():
    """One fresh 300-token prompt: the pace finishes it in ~0.5 s, within the target; and
    background prompts (Batch API work) have no target."""
    from lmstack.sampling_params import BATCH_PRIORITY

    assert prompt_tokens_with([make_seq(300, 4, arrival=NOW)]) == PACE
    background = [make_seq(900, 4, arrival=NOW - 60, priority=BATCH_PRIORITY) for _ in range(3)]
    assert prompt_tokens_with([make_seq(300, 4, arrival=NOW), *background]) == PACE


def test_the_scheduler_shares_the_engines_cost_model_the_draft_policy_keeps_its_own(tiny_model_path):
    """The scheduler reads every step's cost; the draft policy only decode steps' (drafting
    included), so without a speculator its model stays empty."""
    from lmstack.engine.llm_engine import LLMEngine

    engine = LLMEngine({"model": str(tiny_model_path)})
    assert engine.scheduler.step_cost is engine.step_cost
    assert engine.drafts.policy.cost is not engine.step_cost
    engine.enqueue(engine.make_request([1, 2, 3, 4], None))
    while engine.has_unfinished():
        engine.step()
    assert engine.step_cost._buckets, "the engine records its steps"
    assert not engine.drafts.policy.cost._buckets
