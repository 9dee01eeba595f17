"""No request owns the engine (issue 60, item 4): the `continuous` scheduler shares running
slots between requests (a call's prompts counting as one, `Request.group`), and the server
bounds the sequences and the echoed prompt-logprob work one request may ask for."""

from __future__ import annotations

import pytest

from lmstack.components.continuous import ContinuousOptions, ContinuousScheduler
from lmstack.interfaces import EngineLimits
from lmstack.sampling_params import SamplingParams
from lmstack.testing.components import build_component
from lmstack.testing.fakes import make_seq
from lmstack.testing.kit import one_thread, tiny_stack
from lmstack.testing.scheduler import simulate


def _scheduler(max_num_seqs: int, blocks: int, *, fair: bool = True):
    alloc = build_component("paged", "allocator", {"num_blocks": blocks, "block_size": 4})
    limits = EngineLimits(max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=256)
    sched = ContinuousScheduler(ContinuousOptions(max_num_seqs, 256), alloc, limits)
    sched.fair_share = fair
    return sched, alloc, limits


def _hog_and_small(hog_seqs: int, arrive_at: int):
    hog = [make_seq(8, 48, arrival=float(i)) for i in range(hog_seqs)]
    for s in hog:
        s.request.group = "hog"  # one HTTP call's prompts x n
    small = make_seq(4, 4, arrival=1e6)
    return hog, small, {arrive_at: [small]}


class _Steps:
    """Counts `schedule` calls and the step at which each sequence finished."""

    def __init__(self, sched: ContinuousScheduler) -> None:
        self.step, self.finished_at = 0, {}
        schedule, finish = sched.schedule, sched.finish

        def counted():
            self.step += 1
            return schedule()

        def finished(seq):
            self.finished_at[seq.seq_id] = self.step
            finish(seq)

        sched.schedule, sched.finish = counted, finished


@pytest.mark.parametrize("blocks", [4096, 200], ids=["slots-bound", "kv-bound"])
def test_a_small_request_is_not_starved_by_a_thousand_sequences(blocks):
    """32 prompts x n 32 = 1,024 sequences of one call hold every slot (or every KV block);
    a 4-token request arriving at step 5 finishes within a few steps of arriving. Plain FCFS
    (the oracle for the order) runs it only after nearly all of the 1,024."""
    results = {}
    for fair in (True, False):
        sched, alloc, limits = _scheduler(64, blocks, fair=fair)
        hog, small, arrivals = _hog_and_small(1024, 5)
        steps = _Steps(sched)
        finished = simulate(sched, alloc, hog, limits=limits, arrivals=arrivals, max_steps=100_000)
        assert len(finished) == 1025  # everyone finishes, nothing leaks (simulate checks the blocks)
        results[fair] = (steps.finished_at[small.seq_id] - 5, finished.index(small))
    waited, rank = results[True]
    assert waited <= 8, f"the small request took {waited} steps after arriving"
    assert rank < 128
    assert results[False][1] > 900, "FCFS ran the small request after the big call"


def test_many_owners_of_n_sequences_do_not_thrash():
    """Requests of n = 4 each (not forked in this simulation: each holds 4 slots) beside more
    waiting ones: nobody is above an equal share that a newcomer could take, so nothing is
    preempted, and the order stays first come, first served."""
    sched, alloc, limits = _scheduler(16, 4096)
    seqs = [make_seq(8, 8, n=4, arrival=float(i)) for i in range(20)]
    preempted = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    sched.schedule = recording
    finished = simulate(sched, alloc, seqs, limits=limits)
    assert not preempted
    assert [s.seq_id for s in finished] == [s.seq_id for s in seqs]


def test_round_robin_admission_between_two_big_calls():
    """Two calls of 40 sequences each, the second arriving later: once slots free up, the
    second call's sequences are admitted alternately with the first's, not after all of them."""
    sched, alloc, limits = _scheduler(8, 4096)
    first = [make_seq(8, 8, arrival=float(i)) for i in range(40)]
    second = [make_seq(8, 8, arrival=100.0 + i) for i in range(40)]
    for s in first:
        s.request.group = "a"
    for s in second:
        s.request.group = "b"
    finished = simulate(sched, alloc, first, limits=limits, arrivals={2: second})
    order = "".join("a" if s in first else "b" for s in finished)
    # The first of the second call gets a slot at once (the first call held all 8); from then
    # on the two calls hold 4 slots each: b's finish alternately with a's, four by four.
    assert order.index("b") < 10, order
    assert 16 <= order[8:48].count("b") <= 24, order


def _recording(sched):
    """sched.schedule, recording every step's (sequence, tokens, in its prompt) in `sched.steps`."""
    sched.steps = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        sched.steps.append([(x.seq, x.num_tokens, x.seq.is_prefill) for x in out.scheduled])
        return out

    sched.schedule = recording
    return sched


def test_long_prompts_in_progress_leave_room_for_a_newcomer():
    """One call's 8 prompts of 2,000 tokens fill the step's 256-token budget with their
    chunks; a 4-token request arriving at step 3 is prefilled in the next step, not after
    the 60-odd steps those prompts take."""
    sched, alloc, limits = _scheduler(64, 4096)
    _recording(sched)
    hog = [make_seq(2000, 2, arrival=float(i)) for i in range(8)]
    for s in hog:
        s.request.group = "hog"
    small = make_seq(4, 1, arrival=1e6)
    simulate(sched, alloc, hog, limits=limits, arrivals={3: [small]})
    first = next(i for i, step in enumerate(sched.steps) if any(seq is small for seq, _, _ in step))
    assert first == 3, first
    # Meanwhile the prompts went on with the rest of the budget.
    assert sum(n for seq, n, _ in sched.steps[3] if seq is not small) == 252


def test_echoed_prompt_logprobs_run_a_bounded_number_of_rows_a_step():
    from lmstack.components.continuous import PROMPT_LOGPROB_TOKENS

    sched, alloc, limits = _scheduler(64, 4096)
    _recording(sched)
    echo = [make_seq(500, 1, arrival=float(i)) for i in range(3)]
    for s in echo:
        s.request.params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    small = make_seq(4, 2, arrival=1e6)
    simulate(sched, alloc, echo, limits=limits, arrivals={2: [small]})
    rows = [sum(n for seq, n, prefill in step if seq in echo and prefill) for step in sched.steps]
    assert max(rows) <= PROMPT_LOGPROB_TOKENS
    assert sum(rows) >= 3 * 499  # every prompt token's row ran
    first = next(i for i, step in enumerate(sched.steps) if any(seq is small for seq, _, _ in step))
    assert first == 2


# --- the real engine on the tiny model -------------------------------------------------------


def test_the_engine_runs_a_small_request_beside_a_big_call(tiny_model_path):
    """The tiny model's engine holds 32 prompts x n 32 of one call; a 4-token request added
    three steps in finishes within 10 engine steps, with the greedy tokens it gets alone
    (and the big call's are the ones each of its prompts gets alone)."""
    from lmstack.engine.llm import LLM

    stack = tiny_stack(
        tiny_model_path,
        allocator={"name": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 512},
    )
    big = SamplingParams(n=32, temperature=0.0, max_tokens=12, ignore_eos=True)
    small = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with one_thread():
        llm = LLM(stack)
        engine = llm.engine
        alone_small = llm.generate("the cat", small)[0].outputs[0].token_ids
        alone_big = llm.generate(
            "prompt 3 of the call", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        )
        alone_big = alone_big[0].outputs[0].token_ids
        for i in range(32):
            req = engine.make_request(f"prompt {i} of the call", big, request_id=f"big-{i}")
            req.group = "big"
            engine.enqueue(req)
        for _ in range(3):
            engine.step()
        engine.enqueue(engine.make_request("the cat", small, request_id="small"))
        outputs, steps = {}, 0
        while "small" not in outputs:
            steps += 1
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        assert steps <= 10, steps
        assert outputs["small"].outputs[0].token_ids == alone_small
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.shutdown()
    assert all(c.token_ids == alone_big for c in outputs["big-3"].outputs)
    assert len(outputs) == 33 and all(len(o.outputs) == 32 for k, o in outputs.items() if k != "small")


def test_prompt_logprobs_in_small_chunks_equal_those_of_whole_steps(tiny_model_path):
    """The bounded rows a step change nothing but the step count: the prompt logprobs of a
    300-token prompt equal (to fp32 rounding) those computed in one step without the bound."""
    from lmstack.engine.llm import LLM

    stack = tiny_stack(
        tiny_model_path, scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 512}
    )
    ids = [(13 * i) % 250 + 3 for i in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    got = {}
    with one_thread():
        llm = LLM(stack)
        for fair in (True, False):
            llm.engine.scheduler.fair_share = fair
            got[fair] = llm.generate([ids], params)[0].prompt_logprobs
        llm.engine.shutdown()
    assert len(got[True]) == 300 and got[True][0] is None
    for a, b in zip(got[True][1:], got[False][1:], strict=True):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], abs=1e-4) for k in a)
