"""Priority classes in the `continuous` scheduler (issue 59): admission by priority, preemption
of less urgent running sequences, the aging bound, and background work (priority >=
BATCH_PRIORITY) that fills only the capacity interactive work leaves."""

from __future__ import annotations

import pytest

from lmstack.components.continuous import ContinuousOptions, ContinuousScheduler
from lmstack.engine.step_cost import StepCostModel
from lmstack.errors import ConfigError
from lmstack.interfaces import EngineLimits
from lmstack.sampling_params import BATCH_PRIORITY
from lmstack.sequence import SequenceStatus
from lmstack.testing.allocator import check_invariants
from lmstack.testing.components import build_component
from lmstack.testing.fakes import make_seq
from lmstack.testing.scheduler import advance, simulate

A, B = 0.05, 0.001  # a fake measured step cost: 50 ms a step plus 1 ms a query token


def fitted(a: float = A, b: float = B) -> StepCostModel:
    cost = StepCostModel()
    for t in (1, 4, 32, 256):
        for _ in range(2):  # the first step of a size is a warm-up
            cost.record(t, a + b * t)
    return cost


def make(max_num_seqs=4, blocks=4096, tokens=256, *, cost=None, **options):
    alloc = build_component("paged", "allocator", {"num_blocks": blocks, "block_size": 4})
    limits = EngineLimits(max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens)
    # The fake arrival times are not the clock's: no aging unless a test asks for it.
    options.setdefault("priority_aging_s", 0.0)
    opts = ContinuousOptions(max_num_seqs, tokens, **options)
    sched = ContinuousScheduler(opts, alloc, limits, cost)
    return sched, alloc, limits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step(sched: ContinuousScheduler, finished: list | None = None):
    """One engine step without a model (as `simulate` plays it): advance what was scheduled,
    append a token when a sequence reaches its newest one, finish at max_tokens."""
    out = sched.schedule()
    done = advance(sched, out)
    if finished is not None:
        finished.extend(done)
    return out


def test_admission_follows_priority_then_arrival():
    """Sequences all waiting at once, two slots: they finish class by class (lower first),
    first come first served within a class; the oracle is a sort by (priority, arrival)."""
    sched, alloc, limits = make(max_num_seqs=2)
    prios = [5, 0, 9, 0, 5, 1, 9, 0]
    seqs = [make_seq(6, 4, priority=p, arrival=float(i)) for i, p in enumerate(prios)]
    done = simulate(sched, alloc, seqs, limits=limits)
    expect = sorted(seqs, key=lambda s: (s.request.priority, s.arrival_time))
    assert [s.seq_id for s in done] == [s.seq_id for s in expect]
    assert alloc.num_free_blocks() == alloc.num_blocks


@pytest.mark.parametrize("bound", ["slots", "blocks"])
def test_an_urgent_arrival_preempts_the_newest_least_urgent(bound):
    """Low-priority sequences hold every slot (or every KV block); an urgent one arrives and
    runs in the next step, in place of the newest of the least urgent class."""
    blocks = 4096 if bound == "slots" else 12  # 3 sequences x (8 + 8) tokens / 4 = 12 blocks
    sched, alloc, limits = make(max_num_seqs=3 if bound == "slots" else 8, blocks=blocks)
    mid = make_seq(8, 30, priority=3, arrival=0.0)
    low = [make_seq(8, 30, priority=7, arrival=float(i)) for i in (1, 2)]
    for s in (mid, *low):
        sched.add(s)
    for _ in range(9):  # all three decoding, their blocks growing to the cap
        step(sched)
    assert sched.num_running() == 3
    urgent = make_seq(8, 4, priority=0, arrival=50.0)
    sched.add(urgent)
    out = step(sched)
    assert [s.seq_id for s in out.preempted] == [low[1].seq_id], "the newest of the least urgent goes"
    assert urgent.seq_id in {it.seq.seq_id for it in out.scheduled}
    assert mid.status is SequenceStatus.RUNNING and low[0].status is SequenceStatus.RUNNING
    finished: list = []
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step(sched, finished)
        check_invariants(alloc, sched.running_seqs())
    assert finished[0] is urgent and len(finished) == 4
    assert alloc.num_free_blocks() == alloc.num_blocks, "no KV block leaked"


def test_equal_priorities_never_preempt_each_other():
    """A newcomer of the running class is no reason to preempt (the fair share aside, which a
    single-sequence owner never triggers)."""
    sched, alloc, limits = make(max_num_seqs=2)
    for i in range(2):
        sched.add(make_seq(8, 30, priority=2, arrival=float(i)))
    for _ in range(4):
        step(sched)
    sched.add(make_seq(8, 4, priority=2, arrival=10.0))
    assert not step(sched).preempted


@pytest.mark.parametrize("aging_s", [10.0, 0.0])
def test_aging_bounds_the_wait_of_a_less_urgent_request(aging_s):
    """A priority-3 request waits behind a steady stream of priority-0 ones that keeps the only
    slot busy. The clock moves 1 s a step. With aging every 10 s it is admitted once its
    effective priority reaches 0 (3 x 10 s after arriving) and before the next newer priority-0
    request; without aging it waits until the stream ends."""
    sched, alloc, limits = make(max_num_seqs=1, priority_aging_s=aging_s)
    clock = Clock()
    sched.clock = clock
    low = make_seq(4, 2, priority=3, arrival=clock.now)
    sched.add(low)
    admitted_at = None
    for t in range(120):
        if t < 80 and sched.num_waiting() < 3:
            sched.add(make_seq(4, 2, priority=0, arrival=clock.now))
        step(sched)
        if admitted_at is None and low.status is not SequenceStatus.WAITING:
            admitted_at = clock.now - low.arrival_time
        clock.now += 1.0
    assert not sched.has_unfinished()
    if aging_s:
        # Its turn comes at 30 s; the slot then frees within a request's three steps.
        assert 30.0 <= admitted_at <= 33.0, admitted_at
    else:
        assert admitted_at >= 80.0, admitted_at
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_aging_leaves_one_class_in_arrival_order():
    """With one priority in play aging changes nothing: the same steps with it on and off,
    although the arrivals are minutes apart."""
    runs = []
    for aging in (1.0, 0.0):
        sched, alloc, limits = make(max_num_seqs=3, blocks=40, priority_aging_s=aging)
        clock = Clock()
        sched.clock = clock
        seqs = [make_seq(5 + i % 7, 6, priority=4, arrival=clock.now - 600.0 + 37.0 * i) for i in range(12)]
        for s in seqs:
            s.request.group = f"g{len(seqs) % 5}" if s.seq_id % 3 else None
        trace = []
        schedule = sched.schedule

        def traced(schedule=schedule, trace=trace):
            out = schedule()
            trace.append(
                ([(it.seq.seq_id % 1000, it.num_tokens) for it in out.scheduled], len(out.preempted))
            )
            return out

        sched.schedule = traced
        simulate(sched, alloc, seqs, limits=limits)
        runs.append([(ids, p) for ids, p in trace])
        # Ids differ between runs; compare positions in the input instead.
        order = {s.seq_id % 1000: i for i, s in enumerate(seqs)}
        runs[-1] = [([(order[i], n) for i, n in ids], p) for ids, p in runs[-1]]
    assert runs[0] == runs[1]


def test_fair_share_within_a_class():
    """One call's 16 prompts (one owner) of priority 5 fill the slots; a single request of the
    same priority arriving later gets a slot within a few steps (the fair share), and an
    urgent one (priority 0) at once."""
    sched, alloc, limits = make(max_num_seqs=8)
    hog = [make_seq(8, 40, priority=5, arrival=float(i)) for i in range(16)]
    for s in hog:
        s.request.group = "hog"
        sched.add(s)
    for _ in range(5):
        step(sched)
    assert sched.num_running() == 8
    small = make_seq(4, 4, priority=5, arrival=100.0)
    sched.add(small)
    waited = 0
    while small.status is SequenceStatus.WAITING:
        step(sched)
        waited += 1
    assert waited <= 2
    assert sum(1 for s in sched.running if s.request.group == "hog") == 7
    urgent = make_seq(4, 4, priority=0, arrival=101.0)
    sched.add(urgent)
    step(sched)
    assert urgent.status is SequenceStatus.RUNNING
    finished: list = []
    while sched.has_unfinished():
        step(sched, finished)
    assert len(finished) == 18 and alloc.num_free_blocks() == alloc.num_blocks


def _decoding(sched, seqs):
    for s in seqs:
        sched.add(s)
    while any(s.is_prefill or s.status is SequenceStatus.WAITING for s in seqs):
        step(sched)


def test_background_takes_only_the_slack_beside_interactive_decodes():
    """4 interactive streams decode beside 20 running background sequences. With the fake cost
    t(T) = 50 ms + 1 ms x T and slack 0.1, the step with background work may take at most
    1.1 x t(4): 0.1 x (50 + 4) = 5 background tokens. The oldest background ones run; the rest
    keep their KV, paused."""
    cost = fitted()
    sched, alloc, limits = make(max_num_seqs=32, cost=cost, background_slack=0.1)
    batch = [make_seq(6, 100, priority=BATCH_PRIORITY, arrival=float(i)) for i in range(20)]
    _decoding(sched, batch)  # no interactive work: the full batch (rule c)
    assert sched.num_running() == 20
    chat = [make_seq(6, 100, priority=0, arrival=100.0 + i) for i in range(4)]
    for s in chat:
        sched.add(s)
    saw_prompt = False
    for _ in range(3):
        in_prompt = {c.seq_id for c in chat if c.num_output_tokens == 0}
        out = step(sched)
        if in_prompt & {it.seq.seq_id for it in out.scheduled}:
            saw_prompt = True
            # (a) no background prompt chunk beside an interactive prompt; decodes may ride
            assert all(it.num_tokens == 1 for it in out.scheduled if it.seq in batch)
    assert saw_prompt
    for _ in range(5):
        out = step(sched)
        inter = sum(it.num_tokens for it in out.scheduled if it.seq.request.priority < BATCH_PRIORITY)
        bg = [it.seq for it in out.scheduled if it.seq.request.priority >= BATCH_PRIORITY]
        assert inter == 4
        assert len(bg) == int(0.1 * (A / B + inter)) == 5
        assert cost.predict(inter + len(bg)) <= 1.1 * cost.predict(inter) + 1e-12
        running_bg = sorted((s for s in sched.running if s in batch), key=lambda s: s.arrival_time)
        assert bg == running_bg[:5], "the oldest background sequences run"
        assert not out.preempted and sched.num_running() == 24, "the others are paused, not dropped"


def test_background_tokens_are_priced_as_decodes_beside_a_prompt_step():
    """A kinked measured cost: 5 ms a token up to 32 (decodes: attention, sampling), 0.5 ms a
    token beyond (prompt chunks). Beside a 256-token interactive prompt step with 24 sequences
    running, background tokens are priced at the decode slope: 0.1 x t(256) / 5 ms = 6 of
    them, whose decode cost keeps the step within 1.1 x; the prompt slope would allow 63."""
    cost = StepCostModel()
    for t, secs in ((1, 0.05), (8, 0.085), (32, 0.205), (256, 0.317)):
        for _ in range(2):
            cost.record(t, secs)
    sched, alloc, limits = make(max_num_seqs=32, cost=cost, background_slack=0.1)
    sched.running = [make_seq(4, 4) for _ in range(24)]
    t_int = 0.317
    allowed = sched.background_allowance(256)
    assert allowed == int(0.1 * t_int / 0.005) == 6
    assert t_int + allowed * 0.005 <= 1.1 * t_int
    sched.running = []


def test_a_flat_small_step_cost_does_not_let_background_prompts_fill_the_step():
    """Small steps are memory-bound: a measured cost flat at 15 ms up to 32 tokens (a noisy
    larger size pooled with smaller ones reads exactly flat), 300 ms at 256. Priced by the flat
    local slopes, background work beside 2 interactive decodes, and in the grace after them,
    was unbounded: whole-budget steps of background prompts (~300 ms here, ~1 s on the
    benchmark) that the next interactive requests waited for. On the measured curve the step
    stays within 1.1 x 15 ms: at most 32 tokens, background ones included."""
    cost = StepCostModel()
    for t, secs in ((1, 0.015), (8, 0.015), (32, 0.015), (256, 0.3)):
        for _ in range(2):
            cost.record(t, secs)
    sched, alloc, limits = make(max_num_seqs=16, cost=cost, background_slack=0.1, background_grace_s=2.0)
    clock = Clock()
    sched.clock = clock
    chat = [make_seq(6, 4, priority=0, arrival=clock.now) for _ in range(2)]
    batch = [make_seq(50, 50, priority=BATCH_PRIORITY, arrival=clock.now + i) for i in range(12)]
    for s in (*chat, *batch):
        sched.add(s)
    steps = []
    while clock.now < 1001.5:  # the chat requests, then most of the grace after them
        out = step(sched)
        inter = sum(it.num_tokens for it in out.scheduled if it.seq.request.priority < BATCH_PRIORITY)
        steps.append((inter, out.num_batched_tokens))
        clock.now += 0.05
    assert all(c.status is SequenceStatus.FINISHED for c in chat)
    decoding = [(i, n) for i, n in steps if 0 < i <= 2]
    assert decoding and all(n <= 32 for i, n in decoding), steps
    grace = [n for i, n in steps if i == 0]
    assert grace and all(n <= 32 for n in grace), steps
    assert sum(grace) > 0, "background still runs in the slack"
    for i, n in steps:
        if i <= 2:  # the interactive decodes and the grace: within 1.1 x the measured t(i)
            a, b = cost.fit_near(n)
            assert a + b * n <= 1.1 * 0.015 + 1e-12, (i, n)
    while sched.has_unfinished():
        step(sched)
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_background_is_preempted_newest_first_for_an_interactive_slot():
    """Background holds every slot; an interactive request arrives: the newest background
    sequence gives up its slot (and its blocks) in the same step."""
    sched, alloc, limits = make(max_num_seqs=6, cost=fitted())
    batch = [make_seq(6, 100, priority=BATCH_PRIORITY, arrival=float(i)) for i in range(6)]
    _decoding(sched, batch)
    free_before = alloc.num_free_blocks()
    chat = make_seq(6, 3, priority=0, arrival=50.0)
    sched.add(chat)
    out = step(sched)
    assert out.preempted == [batch[-1]] and batch[-1].status is SequenceStatus.WAITING
    assert chat.status is SequenceStatus.RUNNING
    assert alloc.num_free_blocks() >= free_before  # its blocks came back before the newcomer's
    finished: list = []
    while sched.has_unfinished():
        step(sched, finished)
        check_invariants(alloc, sched.running_seqs())
    assert finished[0] is chat and len(finished) == 7
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_a_burst_of_interactive_requests_gets_its_slots_in_one_step():
    """Background holds every slot; four interactive requests arrive at once: the four newest
    background sequences are preempted and all four start in the same step."""
    sched, alloc, limits = make(max_num_seqs=6, cost=fitted())
    batch = [make_seq(6, 100, priority=BATCH_PRIORITY, arrival=float(i)) for i in range(6)]
    _decoding(sched, batch)
    chat = [make_seq(6, 3, priority=0, arrival=50.0 + i) for i in range(4)]
    for s in chat:
        sched.add(s)
    out = step(sched)
    assert out.preempted == batch[:1:-1], "newest first"
    assert all(s.status is SequenceStatus.RUNNING for s in chat)
    finished: list = []
    while sched.has_unfinished():
        step(sched, finished)
    assert {s.seq_id for s in finished[:4]} == {s.seq_id for s in chat}
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_background_waits_without_a_cost_model_or_slack_and_then_gets_everything():
    """No measured cost (or slack 0): no background token while interactive work runs; once it
    is done the background runs as a full batch."""
    for cost, slack in ((None, 0.1), (fitted(), 0.0)):
        sched, alloc, limits = make(max_num_seqs=8, cost=cost, background_slack=slack, background_grace_s=0.0)
        chat = [make_seq(6, 5, priority=0, arrival=0.0)]
        batch = [make_seq(6, 5, priority=BATCH_PRIORITY, arrival=float(i)) for i in range(10)]
        for s in chat + batch:
            sched.add(s)
        while chat[0].status is not SequenceStatus.FINISHED:
            out = step(sched)
            assert all(it.seq is chat[0] for it in out.scheduled)
        out = step(sched)
        assert len(out.scheduled) == 8  # the full batch: every slot
        finished: list = []
        while sched.has_unfinished():
            step(sched, finished)
        assert len(finished) == 10 and alloc.num_free_blocks() == alloc.num_blocks


def _background_after_chat(sched, chat, batch, dt, go_on, alone=False):
    """On a fake clock (`dt` a step): `chat` and `batch` arrive, the chat request runs to its end
    (with `alone`, in steps of its own), then steps go on while `go_on(seconds since the chat's
    last step)`. Returns (those seconds, tokens scheduled) for each step after the chat's."""
    clock = Clock()
    sched.clock = clock
    for s in (chat, *batch):
        sched.add(s)
    while chat.status is not SequenceStatus.FINISHED:
        out = step(sched)
        assert not alone or all(it.seq is chat for it in out.scheduled)
        clock.now += dt
    ended = clock.now - dt  # the last step that saw it
    sizes = []
    while go_on(clock.now - ended):
        out = step(sched)
        sizes.append((clock.now - ended, out.num_batched_tokens))
        clock.now += dt
    return sizes


def test_background_keeps_to_the_slack_for_the_grace_after_interactive_work():
    """Interactive work ends; for background_grace_s (2 s on a fake clock, 0.5 s a step) the
    background still takes only the slack of an empty step, 0.1 x 50 ms / 1 ms = 5 tokens
    (a closed-loop client's next request is about to come); after it, the full batch."""
    sched, alloc, limits = make(max_num_seqs=16, cost=fitted(), background_slack=0.1, background_grace_s=2.0)
    chat = make_seq(6, 2, priority=0, arrival=1000.0)
    batch = [make_seq(6, 50, priority=BATCH_PRIORITY, arrival=1000.0 + i) for i in range(12)]
    sizes = _background_after_chat(sched, chat, batch, 0.5, lambda since: since < 4.0)
    assert all(n <= 5 for t, n in sizes if t < 2.0), sizes
    assert any(n > 5 for t, n in sizes if t >= 2.0), sizes
    while sched.has_unfinished():
        step(sched)
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_by_default_background_runs_only_without_interactive_work():
    """The defaults (slack 0, grace 0.1 s, background steps of at most 100 ms): no background
    token beside an interactive sequence or in the 0.1 s after the last one; then background
    steps sized to the bound (fake cost 50 ms + 1 ms a token: at most 50 tokens)."""
    sched, alloc, limits = make(max_num_seqs=16, cost=fitted())
    assert sched.options.background_slack == 0.0
    chat = make_seq(6, 3, priority=0, arrival=1000.0)
    batch = [make_seq(40, 4, priority=BATCH_PRIORITY, arrival=1000.0 + i) for i in range(6)]
    sizes = _background_after_chat(sched, chat, batch, 0.03, lambda since: sched.has_unfinished(), alone=True)
    assert all(n == 0 for t, n in sizes if t < 0.1), sizes
    later = [n for t, n in sizes if t >= 0.1]
    assert later and max(later) == 50 and all(fitted().predict(n) <= 0.100 + 1e-9 for n in later)
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_the_engine_loop_waits_while_background_is_held_back(tiny_model_path):
    """After interactive work, background waits out the grace with nothing to schedule: the
    engine loop waits (for a moment, or a request) instead of spinning through empty steps."""
    import asyncio

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack.sampling_params import SamplingParams
    from lmstack.testing.kit import tiny_stack

    grace = 1.0
    stack = tiny_stack(
        tiny_model_path,
        scheduler={
            "name": "continuous",
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "background_grace_s": grace,
        },  # fmt: skip
    )
    llm = LLM(stack)
    calls = []
    real_step = llm.engine.step
    llm.engine.step = lambda: (calls.append(llm.engine.stats.num_steps), real_step())[1]
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def run() -> None:
        async for _ in engine.stream(engine.make_request([5, 6, 7], params)):
            pass
        bg = engine.make_request([5, 6, 8], params, priority=BATCH_PRIORITY)
        async for _ in engine.stream(bg):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    held = len(calls) - len(set(calls))  # calls that ran no step
    # ~grace / HELD_BACK_WAIT_S of them; a spinning loop makes tens of thousands.
    assert 0 < held < 2 * grace / 0.005, held


@pytest.mark.parametrize("bound_ms", [150.0, 0.0])
def test_background_only_steps_are_bounded_in_time(bound_ms):
    """Only background work: its prompt chunks are sized so that the step is predicted to take
    at most background_max_step_ms (fake cost: 50 ms + 1 ms a token, so 100 tokens at 150 ms,
    decodes included); 0 lets a step take the whole token budget."""
    cost = fitted()
    sched, alloc, limits = make(max_num_seqs=8, cost=cost, background_max_step_ms=bound_ms)
    batch = [make_seq(100, 6, priority=BATCH_PRIORITY, arrival=float(i)) for i in range(8)]
    for s in batch:
        sched.add(s)
    sizes = []
    while sched.has_unfinished():
        sizes.append(step(sched).num_batched_tokens)
    if bound_ms:
        assert max(sizes) == 100 and all(cost.predict(n) <= 0.150 + 1e-9 for n in sizes)
    else:
        assert sizes[0] == 256
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_mixed_traffic_finishes_without_leaks_under_kv_pressure():
    """Interactive requests of two priorities and background ones arriving over time, with few
    KV blocks: everyone finishes, the scheduler contract holds every step (simulate), nothing
    leaks, and each interactive request finishes before the background ones that arrived with it."""
    sched, alloc, limits = make(max_num_seqs=6, blocks=30, tokens=32, cost=fitted())
    first = [make_seq(10, 12, priority=BATCH_PRIORITY + i % 2, arrival=float(i)) for i in range(12)]
    arrivals = {
        3 + 4 * k: [make_seq(7, 6, priority=k % 2, arrival=20.0 + k), make_seq(9, 8, priority=BATCH_PRIORITY)]
        for k in range(6)
    }
    done = simulate(sched, alloc, first, limits=limits, arrivals=arrivals)
    assert len(done) == 24
    pos = {s.seq_id: i for i, s in enumerate(done)}
    for chat, bg in arrivals.values():
        assert pos[chat.seq_id] < pos[bg.seq_id]
    assert sched.num_preemptions > 0
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_options_are_checked():
    with pytest.raises(ConfigError, match="priority_aging_s"):
        ContinuousOptions(priority_aging_s=-1)
    with pytest.raises(ConfigError, match="background_slack"):
        ContinuousOptions(background_slack=-0.5)
    with pytest.raises(ConfigError, match="background_max_step_ms"):
        ContinuousOptions(background_max_step_ms=-1)
    with pytest.raises(ConfigError, match="background_grace_s"):
        ContinuousOptions(background_grace_s=-1)
