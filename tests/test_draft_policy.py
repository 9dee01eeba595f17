"""The adaptive draft length (`lmstack.spec.draft_policy`) on synthetic step costs and acceptance,
and the feedback the engine gives a speculator (`Speculator.observe`)."""

from __future__ import annotations

import torch

from lmstack import LLM, SamplingParams
from lmstack.interfaces import DraftFeedback, Speculator
from lmstack.spec.draft_policy import MAX_PROBE_BACKOFF, DraftLengthPolicy

pytest_plugins = ["lmstack.testing.fixtures"]


def measured(a: float, b: float, k: int = 4) -> DraftLengthPolicy:
    """A policy that has seen steps costing a + b * T seconds for T = 1 .. 512 (twice each size:
    the first of a size is warm-up)."""
    policy = DraftLengthPolicy(k)
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        policy.record_step(t, 5 * (a + b * t))  # a warm-up outlier, replaced
        policy.record_step(t, a + b * t)
    return policy


def test_memory_bound_steps_draft_everything():
    policy = measured(a=0.05, b=0.0)
    assert policy.limits(list(range(32))) == dict.fromkeys(range(32), 4)


def test_compute_bound_steps_draft_nothing():
    policy = measured(a=0.0005, b=0.002)
    assert policy.limits([0]) == {0: 0}
    assert set(policy.limits(list(range(32))).values()) == {0}


def test_drafts_shrink_as_the_batch_grows_and_come_back():
    policy = measured(a=0.040, b=0.0004)  # memory-bound up to ~100 tokens
    means = []
    for batch in (1, 8, 32, 512, 1):
        limits = policy.limits(list(range(batch)))
        means.append(sum(limits.values()) / batch)
    assert means[0] == 4
    assert means[0] > means[2] > means[3]
    assert means[3] == 0  # 512 query tokens: compute-bound, a 0.6 draft loses
    assert means[4] == means[0]  # the load dropped: full drafts again


def test_the_cost_that_counts_is_the_one_around_the_step():
    """A kinked cost, as on a CPU: memory-bound up to ~8 query tokens, compute-bound from there.
    The global line would call batch 1 compute-bound and 32 streams cheap; the local one drafts
    at batch 1 and not at 32 streams, where every query token costs what a plain one does."""
    policy = DraftLengthPolicy(4)

    def cost(t: int) -> float:
        return 0.006 + 0.0002 * t if t <= 8 else 0.0076 + 0.0022 * (t - 8)

    for t in (1, 2, 4, 8, 32, 64, 128, 160):
        policy.record_step(t, cost(t))
        policy.record_step(t, cost(t))
    assert policy.limits([0]) == {0: 4}
    assert set(policy.limits(list(range(32))).values()) == {0}
    a, b = policy.step_cost(64)
    assert abs(b - 0.0022) < 1e-9


def test_a_chain_that_pays_as_a_whole_is_drafted():
    """A verification's first extra row costs more than the next ones (a multi-row pass has
    fixed costs of its own): one draft alone barely pays, four do. The marginal rule stopped
    after one draft; the step takes the chain length with the most expected tokens a second."""
    policy = DraftLengthPolicy(4)
    for t, seconds in ((1, 0.010), (2, 0.013), (4, 0.0136), (8, 0.0148)):
        policy.record_step(t, seconds)
        policy.record_step(t, seconds)
    assert policy.limits([0]) == {0: 4}
    policy_steep = DraftLengthPolicy(4)
    for t, seconds in ((1, 0.010), (2, 0.017), (4, 0.031), (8, 0.059)):  # every row as dear as a step
        policy_steep.record_step(t, seconds)
        policy_steep.record_step(t, seconds)
    assert policy_steep.limits([0]) == {0: 0}


def test_drafting_is_priced_apart_from_the_verification():
    """A step that is memory-bound for its verification rows still drafts nothing when
    proposing a token costs more than its expected gain is worth (a draft head's passes, under
    load); cheap drafting (an n-gram lookup) leaves the decision to the step's cost."""
    policy = measured(a=0.050, b=0.0)  # memory-bound: verification rows free
    assert set(policy.limits(list(range(8))).values()) == {4}
    policy.record_drafting(8, 8 * 0.030)  # 30 ms a drafted token: dearer than 0.6 of a token
    assert set(policy.limits(list(range(8))).values()) == {0}
    for _ in range(100):
        policy.record_drafting(8, 8 * 0.00001)  # the recent median follows cheaper drafting
    assert set(policy.limits(list(range(8))).values()) == {4}


def test_after_steps_without_drafts_a_few_sequences_retry_first():
    """32 streams where drafting does not pay (each first draft enters the rows its sequence
    queued meanwhile: 30 ms here). Steps without drafts fade the remembered cost until drafting
    is tried again: by PROBE_SEQS sequences, not the whole batch, and what the probe cost
    replaces the faded prices, so the next step drafts nothing again (a cheap probe: everyone)."""
    seqs = list(range(32))

    def until_retry(policy: DraftLengthPolicy) -> dict[int, int]:
        for _ in range(1000):
            limits = policy.limits(seqs)
            if any(limits.values()):
                return limits
        raise AssertionError("never tried again")

    policy = measured(a=0.050, b=0.0)
    for _ in range(16):
        policy.record_drafting(32, 32 * 0.030, 32, 32 * 0.030)
    assert set(policy.limits(seqs).values()) == {0}
    probe = until_retry(policy)
    assert sum(1 for n in probe.values() if n) == policy.probe_seqs == 4
    policy.record_drafting(16, 4 * 0.030, 4, 4 * 0.030)  # as dear as before
    assert set(policy.limits(seqs).values()) == {0}
    until_retry(policy)
    policy.record_drafting(16, 16 * 0.00001, 4, 4 * 0.00001)  # cheap now
    assert set(policy.limits(seqs).values()) == {4}

    # A small batch (here one sequence) retries whole, and its retry's cost joins the faded ones.
    single = measured(a=0.050, b=0.0)
    for _ in range(16):
        single.record_drafting(1, 0.030, 1, 0.030)
    for _ in range(1000):
        if single.limits([0])[0]:
            break
    else:
        raise AssertionError("never tried again")
    single.record_drafting(1, 0.030, 1, 0.030)  # one dear sample among sixteen faded ones
    assert single.limits([0])[0] > 0

    uncapped = measured(a=0.050, b=0.0)
    uncapped.probe_seqs = 0
    for _ in range(16):
        uncapped.record_drafting(32, 32 * 0.030, 32, 32 * 0.030)
    assert all(until_retry(uncapped).values())  # the whole batch at once


def test_fruitless_probes_come_less_often_and_drafting_resumes_where_it_pays():
    """A steady load where drafting never pays: each probe that finds it still does not pay
    halves the fade, so the steps between probes double (up to MAX_PROBE_BACKOFF times); a
    smaller batch, where the measured prices pay, drafts at once, and the backoff is reset."""
    seqs = list(range(32))

    def dear(backoff_max: int) -> DraftLengthPolicy:
        policy = measured(a=0.050, b=0.0)
        policy.max_probe_backoff = backoff_max
        for _ in range(16):
            policy.record_drafting(32, 32 * 0.030, 32, 32 * 0.030)
        return policy

    def gaps(policy: DraftLengthPolicy, probes: int) -> list[int]:
        out = []
        for _ in range(probes):
            for n in range(1, 10_000):
                if any(policy.limits(seqs).values()):
                    out.append(n)
                    break
            else:
                raise AssertionError("never tried again")
            policy.record_drafting(16, 4 * 0.030 + 12 * 0.001, 4, 4 * 0.030)  # still as dear
        return out

    policy = dear(MAX_PROBE_BACKOFF)
    g = gaps(policy, MAX_PROBE_BACKOFF + 3)
    for i in range(1, MAX_PROBE_BACKOFF):  # (the first probe's measurement replaces 16 samples)
        assert 1.9 < g[i + 1] / g[i] < 2.1, g
    assert g[-1] == g[-2] == g[-3], g  # capped
    assert policy._probe_backoff == MAX_PROBE_BACKOFF
    # One sequence: a chain of four (~1.3 tokens for 33 ms) pays in a 50 ms step.
    assert policy.limits([0])[0] > 0
    policy.record_drafting(4, 0.030 + 3 * 0.001, 1, 0.030)
    assert policy.limits([0])[0] > 0 and policy._probe_backoff == 0

    flat = dear(0)  # the backoff off: every probe waits as long as the second one
    g = gaps(flat, 4)
    assert g[1] == g[2] == g[3], g


def test_a_gain_within_the_models_error_drafts_nothing():
    """32 streams on a CPU as measured: steps cost the same from 16 to 33 tokens (the 32-token
    bucket's mean sits at 33 once drafts ride along), 0.4 ms a token above; a draft pass costs
    0.25 ms for a 0.6-token gain. One sequence's draft, its row priced free, raises the
    modelled tokens/s by ~0.3 %: within the model's error, so nothing is drafted. Cheap drafts
    at batch 1 (a clear gain) still are."""
    policy = DraftLengthPolicy(4)
    for t, seconds in ((1, 0.016), (2, 0.016), (4, 0.016), (8, 0.016), (16, 0.016), (33, 0.016)):
        policy.record_step(t, seconds)
        policy.record_step(t, seconds)
    policy.record_step(64, 0.016 + 31 * 0.0004)
    policy.record_step(64, 0.016 + 31 * 0.0004)
    for _ in range(16):
        policy.record_drafting(32, 32 * 0.00025, 32, 32 * 0.00025)
    one_draft = (32 + policy.gains(0, 1)[0]) / (0.016 + 0.00025)  # expected tokens/s
    assert 1.0 < one_draft / (32 / 0.016) < 1.01  # what the rule without a margin took
    assert set(policy.limits(list(range(32))).values()) == {0}
    assert policy.limits([0]) == {0: 4}


def test_a_first_draft_and_a_further_one_are_priced_apart():
    """Batch 1 on a CPU (a 5 ms step, 0.4 ms a further row) with a draft head whose first draft
    takes 0.8 ms (a pass over the rows verified since, then the draft) and each further one
    0.3 ms, each accepted half the time: priced alike (the mean of one- and two-draft steps) a
    second draft looks dearer than its gain; priced apart, two or more pay."""
    alike, apart = measured(a=0.005, b=0.0004), measured(a=0.005, b=0.0004)
    for policy in (alike, apart):
        for i in range(40):  # half of the first drafts accepted, then half of the second ones
            policy.record_verification(0, 2, (0, 0, 1, 2)[i % 4])
    for _ in range(8):
        alike.record_drafting(1, 0.0008)  # a speculator that does not say: all drafts alike
        alike.record_drafting(2, 0.0011)
        apart.record_drafting(1, 0.0008, 1, 0.0008)
        apart.record_drafting(2, 0.0011, 1, 0.0008)
    assert apart.first_draft_seconds == 0.0008 and abs(apart.draft_seconds - 0.0003) < 1e-12
    assert alike.limits([0]) == {0: 1}
    assert apart.limits([0])[0] >= 2
    # Only one-draft steps measured: a further draft is priced as a first one until measured.
    fresh = measured(a=0.005, b=0.0004)
    fresh.record_drafting(1, 0.0008, 1, 0.0008)
    assert fresh.draft_seconds == fresh.first_draft_seconds == 0.0008
    # A first draft dearer than the whole chain's gain: nothing drafted, however cheap the rest.
    for _ in range(16):
        apart.record_drafting(2, 0.0203, 1, 0.02)
    assert apart.limits([0]) == {0: 0}


def test_a_confident_drafter_gets_whole_chains_and_the_break_even_gain():
    """A speculator that stops by its own confidence: the sequences chosen to draft get the
    whole num_draft_tokens and min_gain is what one more query token adds to the step times the
    step's expected rate; under load nobody drafts and the gain is 0; not adaptive, 0 too."""
    policy = measured(a=0.005, b=0.0004, k=6)
    for _ in range(40):
        policy.record_verification(0, 2, 1)
    for _ in range(8):
        policy.record_drafting(2, 0.0011, 1, 0.0008)  # first draft 0.8 ms, a further one 0.3 ms
    plain = policy.limits([0])[0]
    assert 1 <= plain < 6
    policy.confidence = True
    assert policy.limits([0]) == {0: 6}
    # Recompute what limits chose (expected tokens per second over the prefixes) by hand.
    gains = policy.gains(0, 6)
    best_rate, best, expected, drafting = 1 / 0.0054, 0, 1.0, 0.0
    for n in range(1, 7):
        expected += gains[n - 1]
        drafting += 0.0008 if n == 1 else 0.0003
        rate = expected / (0.005 + 0.0004 * (1 + n) + drafting)
        if rate > best_rate:
            best, best_rate = n, rate
    assert best == plain
    assert abs(policy.min_gain - 0.0004 * best_rate) < 1e-9 * best_rate
    assert 0.05 < policy.min_gain < 0.5
    # Compute-bound: nobody drafts, no bar.
    loaded = measured(a=0.0005, b=0.002, k=6)
    loaded.confidence = True
    assert set(loaded.limits(list(range(32))).values()) == {0} and loaded.min_gain == 0.0
    fixed = DraftLengthPolicy(6, adaptive=False, confidence=True)
    assert fixed.limits([0]) == {0: 6} and fixed.min_gain == 0.0


def test_acceptance_is_measured_per_depth():
    """A drafter whose first draft is a coin flip but whose later drafts, once reached, are
    nearly sure (a draft head's chains): the per-depth rates find it, the chain's gains are
    theirs rather than alpha**k, and a step that prices drafts near break-even drafts the whole
    chain where the pooled rate drafts less."""
    deep, pooled = (measured(a=0.005, b=0.0004, k=4) for _ in range(2))
    pooled.by_depth = False
    for policy in (deep, pooled):
        for i in range(200):
            policy.record_verification(0, 4, 4 if i % 2 else 0)
    rates = deep.depth_rates(4)
    assert abs(rates[0] - 0.5) < 0.05 and min(rates[1:]) > 0.9
    alpha = deep.acceptance(0)
    assert 0.7 < alpha < 0.85  # pooled: 4 accepted per 1 rejected over two verifications
    gains = deep.gains(0, 4)
    assert all(abs(g - 0.5) < 0.06 for g in gains[1:]) and abs(gains[0] - 0.5) < 0.05
    assert pooled.gains(0, 4) == [alpha**k for k in range(1, 5)]
    for policy in (deep, pooled):
        for _ in range(16):
            policy.record_drafting(2, 0.0018, 1, 0.0008)  # first draft 0.8 ms, a further one 1 ms
    assert deep.limits([0]) == {0: 4} and pooled.limits([0])[0] < 4
    # Depths never reached take the deepest measured rate: one-draft chains give alpha**k.
    single = measured(a=0.005, b=0.0004, k=4)
    for i in range(100):
        single.record_verification(0, 1, i % 3 != 0)
    rates = single.depth_rates(4)
    assert rates[1:] == [rates[0]] * 3
    assert max(abs(g - single.acceptance(0) ** k) for k, g in enumerate(single.gains(0, 4), 1)) < 0.02


def test_a_slow_long_step_does_not_lock_a_confident_drafters_bar_high():
    """The bar is priced where the step starts: one slow step of a long chain (a hiccup)
    barely moves it, and what the chains then run keeps it measured. Priced at the chain's
    full length, that one step tripled the bar, chains stopped short of that length, and it
    stayed there (the size was never measured again)."""
    policy = DraftLengthPolicy(5, confidence=True)
    for t, seconds in ((1, 0.0040), (2, 0.0043), (3, 0.0045), (5, 0.0050), (6, 0.0052)):
        policy.record_step(t, seconds)
        policy.record_step(t, seconds)
    for i in range(100):
        policy.record_verification(0, 3, i % 4)
    for _ in range(8):
        policy.record_drafting(3, 0.0006, 1, 0.0002)
    assert policy.limits([0]) == {0: 5}
    before = policy.min_gain
    assert 0.05 < before < 0.2
    policy.record_step(5, 0.012)  # one slow five-token step
    policy.limits([0])
    assert policy.min_gain < 1.2 * before
    for _ in range(50):  # then only short chains
        policy.record_step(2, 0.0043)
        policy.record_step(1, 0.0040)
    policy.limits([0])
    assert abs(policy.min_gain - before) < 0.2 * before


def test_before_two_sizes_are_measured_steps_alternate_one_draft_and_none():
    policy = DraftLengthPolicy(3)
    assert [policy.limits([1, 2]) for _ in range(4)] == [{1: 1, 2: 1}, {1: 0, 2: 0}] * 2
    policy.record_step(4, 0.01)
    policy.record_step(4, 0.01)  # one size measured: no fit yet
    assert [policy.limits([1])[1] for _ in range(4)] == [1, 0, 1, 0]
    policy.record_step(1, 0.009)
    policy.record_step(1, 0.009)  # a second size: the measured cost decides from now on
    assert [policy.limits([1])[1] for _ in range(4)] == [3] * 4


def test_sequences_that_accept_more_get_more():
    policy = measured(a=0.040, b=0.0004)
    for _ in range(20):
        policy.record_verification(1, 4, 4)  # seq 1: everything accepted
        policy.record_verification(2, 4, 0)  # seq 2: nothing
    limits = policy.limits(list(range(48)))
    assert limits[1] > limits[2]
    assert policy.acceptance(1) > 0.9 > 0.2 > policy.acceptance(2)


def test_a_sequence_kept_from_drafting_is_tried_again():
    """A sequence whose drafts were all rejected stops drafting; steps without drafts fade its
    record towards the engine's rate, so it drafts again later (its text may have changed)."""
    policy = measured(a=0.006, b=0.0015)
    for _ in range(30):
        policy.record_verification(1, 1, 1)  # the engine: half accepted
        policy.record_verification(2, 1, 0)
    for _ in range(10):
        policy.record_verification(3, 1, 0)
    assert policy.limits([3]) == {3: 0}
    got = [policy.limits([3])[3] for _ in range(40)]
    assert got[0] == 0 and got[-1] > 0


def test_rejected_sequences_drift_back_to_the_engine_rate():
    policy = DraftLengthPolicy(4)
    for _ in range(20):
        policy.record_verification(7, 4, 0)
    low = policy.acceptance(7)
    for _ in range(200):
        policy.record_verification(8, 4, 4)  # others keep accepting
    assert policy.acceptance(7) > low


def test_not_adaptive_is_fixed():
    fixed = measured(a=0.0005, b=0.002, k=3)
    fixed.adaptive = False
    assert fixed.limits([1, 2]) == {1: 3, 2: 3}


class Recording(Speculator):
    """Drafts a fixed continuation guess (the sequence's last token repeated) and records the
    feedback, asking for the final-norm hidden states."""

    num_draft_tokens = 3
    adaptive = False

    def __init__(self, num_layers: int) -> None:
        self.hidden_state_layers = (num_layers,)
        self.feedback: list[DraftFeedback] = []
        self.limits: list[int] = []

    def propose(self, seqs):
        self.limits += [s.draft_limit for s in seqs]
        return {s.seq_id: [s.token_ids[-1]] * s.draft_limit for s in seqs}

    def observe(self, feedback):
        self.feedback += feedback


def test_the_speculator_observes_every_sampled_step_with_hidden_states(tiny_model_path):
    llm = LLM(
        {
            "model": str(tiny_model_path),
            "dtype": "float32",
            "allocator": {"name": "paged", "block_size": 4, "kv_cache_memory": "16MiB"},
        }
    )
    eng = llm.engine
    spec = Recording(eng.model_config.num_layers)
    eng.speculator = spec
    eng.hidden_state_layers = spec.hidden_state_layers
    out = llm.generate(
        [[3, 4, 5, 3, 4, 5, 3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    tokens = out[0].outputs[0].token_ids
    assert spec.limits and set(spec.limits) <= {1, 2, 3}  # never past max_tokens - 1 - emitted
    # Every step's appended tokens, in order, are the output; drafts were verified.
    assert [t for f in spec.feedback for t in f.new_token_ids] == tokens
    assert any(f.num_drafted for f in spec.feedback)
    model = eng.executor.runner.model
    for f in spec.feedback:
        assert isinstance(f, DraftFeedback) and 0 <= f.num_accepted <= f.num_drafted
        assert len(f.new_token_ids) == f.num_accepted + 1
        (h,) = f.hidden_states.values()
        assert h.shape == (f.num_accepted + 1, eng.model_config.hidden_size)
        # The final-norm states are what the LM head read: greedy picked their argmax.
        with torch.no_grad():
            assert model.lm_head(h).argmax(-1).tolist() == f.new_token_ids


class RecordingAll(Recording):
    hidden_state_positions = "all"


def _states_by_position(feedback: list[DraftFeedback], seq_id: int) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for f in feedback:
        if f.seq.seq_id != seq_id:
            continue
        (h,) = f.hidden_states.values()
        for i in range(h.shape[0]):
            assert f.first_position + i not in out, "a position's state came back twice"
            out[f.first_position + i] = h[i]
    return out


def test_all_positions_cover_prompt_chunks_and_kept_drafts(tiny_model_path):
    """hidden_state_positions = "all": every position the sequence computed and kept comes back
    once (prompt chunks of 4 tokens included), and each equals the state a single forward over
    the final tokens computes there."""

    def run(prompt, max_tokens, budget):
        llm = LLM(
            {
                "model": str(tiny_model_path),
                "dtype": "float32",
                "allocator": {"name": "paged", "block_size": 4, "kv_cache_memory": "16MiB"},
                "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": budget},
            }
        )
        eng = llm.engine
        spec = RecordingAll(eng.model_config.num_layers)
        eng.speculator = spec
        eng.hidden_state_layers = spec.hidden_state_layers
        eng.all_hidden_rows = True
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([prompt], params)[0]
        seq_id = spec.feedback[0].seq.seq_id
        return out.outputs[0].token_ids, _states_by_position(spec.feedback, seq_id)

    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 9]
    tokens, states = run(prompt, 10, budget=4)
    full = prompt + tokens
    # Positions 0 .. len(full) - 2 were computed and kept (the last token never enters the cache).
    assert sorted(states) == list(range(len(full) - 1))
    _, reference = run(full[:-1], 1, budget=256)
    for pos in range(len(full) - 1):
        torch.testing.assert_close(states[pos], reference[pos], atol=1e-4, rtol=1e-4)
