"""The rejection sampler on a 5-token vocabulary: emitted tokens follow the target distribution
for deterministic and sampling drafters, greedy verification is argmax-exact, seeded requests
are reproducible, a processor error ends only the verification; and the draft book that
trims proposals to what a request may still emit."""

from __future__ import annotations

import pytest
import torch

from lmstack.engine.output_processor import OutputProcessor
from lmstack.interfaces import Speculator
from lmstack.sample.sampler import Sampler, SampleRow
from lmstack.sample.verification import Draft, RejectionSampler
from lmstack.sampling_params import SamplingParams
from lmstack.spec.drafts import DraftBook
from lmstack.testing.fakes import make_seq

V = 5
P = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])  # the target's distribution at every position
Q = torch.tensor([0.05, 0.10, 0.50, 0.30, 0.05])  # a drafter that samples, far from P
TRIALS = 6000
# Pearson chi-square with V - 1 = 4 degrees of freedom: P(X > 18.47) = 0.001. The runs are
# seeded, so the test is deterministic; a correct sampler lands far below, a wrong rule far above.
CHI2_CRIT = 18.47


def _logits() -> torch.Tensor:
    # At temperature 1 without top-k/top-p the sampler's distribution is softmax(log P) = P.
    return torch.log(P).repeat(3, 1)  # rows for two draft positions and the bonus position


def _row_for(params: SamplingParams):
    def row(extra: list[int]) -> SampleRow:
        return SampleRow(params, [0, *extra], prompt_len=1, sample_index=0)

    return row


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_tokens(draft_fn, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    verifier = RejectionSampler(Sampler(V, seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        result = verifier.verify(_logits(), draft_fn(gen), _row_for(params))
        assert result.error is None and len(result.tokens) == result.num_accepted + 1
        counts[result.tokens[0].token_id] += 1
    return counts


def _sampling_drafter(gen: torch.Generator) -> Draft:
    toks = torch.multinomial(Q, 2, replacement=True, generator=gen).tolist()
    return Draft(toks, Q.repeat(2, 1))


def test_sampling_drafter_emits_the_target_distribution():
    counts = _first_tokens(_sampling_drafter, SamplingParams(temperature=1.0))
    assert _chi2(counts, P) < CHI2_CRIT, counts
    # The test has teeth: the draft distribution itself is rejected by a wide margin.
    assert _chi2(counts, Q) > 50 * CHI2_CRIT


def test_deterministic_drafter_emits_the_target_distribution():
    # q one-hot: accept x with probability p(x), otherwise sample p without x.
    counts = _first_tokens(lambda gen: Draft([2, 2]), SamplingParams(temperature=1.0))
    assert _chi2(counts, P) < CHI2_CRIT, counts


def test_second_position_follows_the_target_too():
    verifier = RejectionSampler(Sampler(V, seed=3))
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    params = SamplingParams(temperature=1.0)
    for _ in range(TRIALS):
        result = verifier.verify(_logits(), _sampling_drafter(gen), _row_for(params))
        if len(result.tokens) >= 2:  # first draft accepted: the next token is again ~ P
            counts[result.tokens[1].token_id] += 1
    assert counts.sum() > TRIALS / 4
    assert _chi2(counts, P) < CHI2_CRIT, counts


def test_acceptance_rate_matches_theory():
    # E[accept first draft] = sum_x min(p(x), q(x)) for a drafter that samples from q.
    verifier = RejectionSampler(Sampler(V, seed=5))
    gen = torch.Generator().manual_seed(6)
    params = SamplingParams(temperature=1.0)
    accepted = sum(
        verifier.verify(_logits(), _sampling_drafter(gen), _row_for(params)).num_accepted >= 1
        for _ in range(TRIALS)
    )
    expected = float(torch.minimum(P, Q).sum())
    # Binomial standard deviation sqrt(p(1-p)/n) is about 0.0064 here; allow 4 of them.
    assert abs(accepted / TRIALS - expected) < 4 * (expected * (1 - expected) / TRIALS) ** 0.5


def test_greedy_accepts_while_drafts_equal_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0, 9.0]])
    verifier = RejectionSampler(Sampler(V))
    params = SamplingParams(temperature=0.0)
    # Drafter probabilities are irrelevant to greedy verification.
    all_ok = verifier.verify(logits, Draft([1, 3], Q.repeat(2, 1)), _row_for(params))
    assert [s.token_id for s in all_ok.tokens] == [1, 3, 4] and all_ok.num_accepted == 2
    second_wrong = verifier.verify(logits, Draft([1, 0]), _row_for(params))
    assert [s.token_id for s in second_wrong.tokens] == [1, 3] and second_wrong.num_accepted == 1
    first_wrong = verifier.verify(logits, Draft([2, 3]), _row_for(params))
    assert [s.token_id for s in first_wrong.tokens] == [1] and first_wrong.num_accepted == 0


def test_greedy_fast_path_gives_the_general_walks_outcome():
    """A greedy row nothing processes is verified by one argmax over the rows; a processor that
    changes nothing sends the same row through the general walk (process, one-hot, argmax per
    row): same tokens and count on random logits (ties and a NaN row included), random drafts
    that match the argmax for a random prefix."""
    gen = torch.Generator().manual_seed(7)
    fast_params = SamplingParams(temperature=0.0)
    walk_params = SamplingParams(temperature=0.0, logits_processors=[lambda ids, logits: logits])
    verifier = RejectionSampler(Sampler(1000, seed=0))
    for trial in range(300):
        k = int(torch.randint(1, 9, (1,), generator=gen))
        logits = torch.randn(k + 1, 1000, generator=gen)
        if trial % 5 == 0:  # ties: the first of equal maxima wins, in both paths
            logits[:, 17] = logits[:, 3] = logits.max() + 1
        if trial % 7 == 0:
            logits[int(torch.randint(0, k + 1, (1,), generator=gen)), 11] = float("nan")
        best = torch.argmax(logits, dim=-1).tolist()
        keep = int(torch.randint(0, k + 1, (1,), generator=gen))
        draft = best[:keep] + torch.randint(0, 1000, (k - keep,), generator=gen).tolist()
        fast = verifier.verify(logits, Draft(draft), _row_for(fast_params))
        walk = verifier.verify(logits, Draft(draft), _row_for(walk_params))
        assert fast.num_accepted == walk.num_accepted, (trial, draft, best)
        assert [t.token_id for t in fast.tokens] == [t.token_id for t in walk.tokens]
        assert fast.num_accepted == next((j for j in range(k) if draft[j] != best[j]), k)


def test_seeded_requests_verify_reproducibly():
    params = SamplingParams(temperature=1.0, seed=42)

    def run(sampler_seed: int) -> list[list[int]]:
        # A different engine-wide generator must not change a seeded request's decisions.
        verifier = RejectionSampler(Sampler(V, seed=sampler_seed))
        out = []
        for i in range(40):
            row_for = lambda extra, i=i: SampleRow(params, [0] * (i + 1) + extra, 1, 0)  # noqa: E731
            out.append([s.token_id for s in verifier.verify(_logits(), Draft([2, 3]), row_for).tokens])
        return out

    first = run(0)
    assert first == run(1)
    assert len({len(t) for t in first}) > 1, "acceptance varies with the output position"


def test_logprobs_of_accepted_drafts_are_the_targets():
    params = SamplingParams(temperature=1.0, logprobs=2, seed=0)
    logits = torch.log(P).repeat(2, 1)
    verifier = RejectionSampler(Sampler(V))
    result = verifier.verify(
        logits, Draft([0], torch.tensor([[1e-3, 0.25, 0.25, 0.25, 0.249]])), _row_for(params)
    )
    assert result.num_accepted == 1  # q(0) << p(0): always accepted
    first = result.tokens[0]
    assert first.token_id == 0 and first.logprob == pytest.approx(float(torch.log(P[0])), abs=1e-5)
    assert set(first.top_logprobs) == {0, 1}


def test_a_failing_processor_ends_the_verification_with_its_error():
    def broken(token_ids, logits):
        raise RuntimeError("boom")

    params = SamplingParams(temperature=1.0, logits_processors=[broken])
    result = RejectionSampler(Sampler(V)).verify(_logits(), Draft([1, 2]), _row_for(params))
    assert result.tokens == [] and result.num_accepted == 0 and "boom" in result.error


def test_draft_probs_must_match_the_draft():
    with pytest.raises(ValueError, match="shape"):
        Draft([1, 2], torch.ones(3, V) / V)
    with pytest.raises(ValueError, match="logits rows"):
        RejectionSampler(Sampler(V)).verify(torch.zeros(2, V), Draft([1, 2]), _row_for(SamplingParams()))


# --- the draft book: proposals in, trimmed drafts out -----------------------------------------


class _Speculator(Speculator):
    num_draft_tokens = 4
    adaptive = False  # the book's trimming is under test here, not the draft length policy

    def __init__(self, proposals):
        self.proposals = proposals

    def propose(self, seqs):
        return {s.seq_id: self.proposals(s) for s in seqs}


def test_draft_book_trims_to_the_room_left_and_keeps_probs():
    outputs = OutputProcessor(None, frozenset(), max_model_len=64)
    seq = make_seq(10, max_tokens=3)
    seq.token_ids.append(1)  # one output token; decoding: only the newest is not in the cache
    seq.num_computed_tokens = 10
    prefilling = make_seq(10)
    probs = torch.softmax(torch.randn(4, V), -1)
    book = DraftBook(outputs)
    book.propose(_Speculator(lambda s: Draft([1, 2, 3, 4], probs)), [seq, prefilling])
    # max_tokens 3, one emitted: two more, one of which the step itself samples.
    assert seq.draft_token_ids == [1] and prefilling.draft_token_ids == []
    taken = book.take(seq, [1])
    assert taken.token_ids == [1] and torch.equal(taken.probs, probs[:1])
    assert book.take(seq, [1]).probs is None, "taken once; afterwards a plain deterministic draft"


def test_draft_book_accepts_token_lists_and_ignores_stale_proposals():
    outputs = OutputProcessor(None, frozenset(), max_model_len=64)
    seq = make_seq(4, max_tokens=20)
    seq.num_computed_tokens = 3
    book = DraftBook(outputs)
    book.propose(_Speculator(lambda s: [7, 8]), [seq])
    assert seq.draft_token_ids == [7, 8]
    stale = book.take(seq, [7])  # the scheduled drafts differ from the proposal: no reuse
    assert stale.token_ids == [7] and stale.probs is None


def test_the_draft_book_times_only_steps_that_decode():
    """The draft policy's cost model hears of a step only when it ran no prefill chunk."""
    outputs = OutputProcessor(None, frozenset(), max_model_len=64)
    decoding = make_seq(4, max_tokens=20)
    decoding.num_computed_tokens = 3
    prefilling = make_seq(10)
    book = DraftBook(outputs)
    book.propose(_Speculator(lambda s: [7]), [decoding, prefilling])
    book.step_timed(11, 0.05)
    assert not book.policy.cost._buckets
    book.propose(_Speculator(lambda s: [7]), [decoding])
    book.step_timed(2, 0.01)
    assert list(book.policy.cost._buckets) == [1]
