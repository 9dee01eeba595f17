"""Speculator conformance: drafts never change what a request gets.

Two checks. Statistically, the core's rejection sampler (`lmstack.sample.verification`), given drafts
from a known draft distribution q, emits tokens distributed as the target p: on a 6-token
vocabulary with fixed p and q, 2000 seeded verifications per case, the total-variation distance
between the emitted first tokens' frequencies and p must stay under 0.05 (its expected value at
this sample size is ~0.02; a sampler that accepts every draft lands at TV(p, q) = 0.35).
Deterministic under the seed. End to end, on the tiny model, greedy decoding with the speculator
gives exactly the tokens of decoding without one, for prompts that include repetitive text, and
every proposal is sane: at most `num_draft_tokens` drafts of valid token ids; the same holds
under chunked prefill, preemption and requests arriving into a running batch (no KV block
leaks), with per-token logprobs (equal to plain decoding's), stop strings and `max_tokens`
landing inside a draft, and n = 2; and over a prefix cache (prompts whose opening blocks the
target never computes for them, so a drafter gets no hidden states there), where a `prefix`
cache is installed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lmstack.interfaces import Speculator
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import (
    KIT_PROMPTS,
    ComponentKit,
    generate,
    greedy,
    kit_llm,
    reference_llm,
    tiny_stack,
)

# The synthetic case: target p and draft q over 6 tokens, far apart (TV(p, q) = 0.35).
TARGET = (0.30, 0.25, 0.20, 0.10, 0.10, 0.05)
DRAFT = (0.05, 0.10, 0.10, 0.20, 0.25, 0.30)
SAMPLES = 2000
TV_BOUND = 0.05


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def verified_first_tokens(
    p: torch.Tensor, q: torch.Tensor | None, *, draft_token: int = 0, samples: int = SAMPLES, seed: int = 0
) -> torch.Tensor:
    """Counts [V] of the first token the core's rejection sampler emits over `samples`
    verifications of one-token drafts against target p: drafts drawn from q with q given to
    the sampler (a sampling drafter), or, with q None, always `draft_token` (a deterministic
    drafter)."""
    from lmstack.sample.sampler import Sampler, SampleRow
    from lmstack.sample.verification import Draft, RejectionSampler

    vocab = p.shape[0]
    sampler = Sampler(vocab, seed=seed)
    verifier = RejectionSampler(sampler)
    draws = torch.Generator().manual_seed(seed + 1)
    row = SampleRow(SamplingParams(temperature=1.0, max_tokens=4), [0], 1, 0)
    logits = p.log().expand(2, vocab).contiguous()
    counts = torch.zeros(vocab)
    for _ in range(samples):
        if q is None:
            draft = Draft([draft_token])
        else:
            draft = Draft([int(torch.multinomial(q, 1, generator=draws))], q.unsqueeze(0))
        result = verifier.verify(logits, draft, lambda extra: row)
        assert result.error is None and result.tokens, "verification emitted nothing"
        counts[result.tokens[0].token_id] += 1
    return counts


class SpeculatorConformance(ComponentKit):
    """Set `component` (a registered speculator name or Component) and optionally `options`.

    `max_tokens` is how far each prompt is decoded in the end-to-end check. After it runs,
    `self.proposals` holds every proposal (seq_id -> drafts) and `self.stats` the engine's
    statistics, for a subclass to assert more (e.g. that drafts were accepted)."""

    kind = "speculator"
    max_tokens: ClassVar[int] = 24
    prompts: ClassVar[tuple[str, ...]] = KIT_PROMPTS

    def test_verification_keeps_the_target_distribution(self) -> None:
        p, q = torch.tensor(TARGET), torch.tensor(DRAFT)
        for case, (draft_q, token) in {"sampled drafts": (q, 0), "deterministic drafts": (None, 5)}.items():
            tv = total_variation(verified_first_tokens(p, draft_q, draft_token=token), p)
            assert tv <= TV_BOUND, f"{case}: emitted tokens are {tv:.3f} from the target in TV > {TV_BOUND}"

    def test_greedy_tokens_identical_to_plain_decoding(self, tiny_model_path) -> None:
        """Greedy tokens equal plain decoding's; proposals are sane; seeded sampled requests
        complete."""
        llm = kit_llm(self, tiny_model_path)
        spec = llm.engine.speculator
        assert isinstance(spec, Speculator)
        vocab = llm.engine.model_config.vocab_size
        self.proposals: list[dict[int, Any]] = []
        inner = spec.propose

        def recording(seqs):
            out = inner(seqs)
            self.proposals.append(out)
            return out

        spec.propose = recording  # type: ignore[method-assign]
        try:
            ours = greedy(llm, list(self.prompts), self.max_tokens)
        finally:
            del spec.propose
        theirs = greedy(reference_llm(tiny_stack(tiny_model_path)), list(self.prompts), self.max_tokens)
        for prompt, a, b in zip(self.prompts, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, (
                f"prompt {prompt!r}: greedy tokens with the speculator {a.token_ids} differ from "
                f"plain decoding's {b.token_ids}"
            )
        for proposal in self.proposals:
            for seq_id, drafts in proposal.items():
                tokens = list(getattr(drafts, "token_ids", drafts))
                assert len(tokens) <= spec.num_draft_tokens, (
                    f"seq {seq_id}: {len(tokens)} drafts proposed, more than num_draft_tokens="
                    f"{spec.num_draft_tokens}"
                )
                assert all(isinstance(t, int) and 0 <= t < vocab for t in tokens), (
                    f"seq {seq_id}: draft tokens {tokens} are not token ids in [0, {vocab})"
                )
        # Sampled requests verify by rejection sampling (with the drafter's probabilities, if it
        # gives them): they must run to their length without an error.
        sampled = generate(
            llm, list(self.prompts), SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
        )
        for prompt, out in zip(self.prompts, sampled, strict=True):
            assert out.error is None and len(out.token_ids) == 8, f"prompt {prompt!r}: sampled run gave {out}"
        self.stats = llm.get_stats()
        assert 0 <= self.stats.num_accepted_tokens <= self.stats.num_draft_tokens
        if not spec.num_draft_tokens:
            assert self.stats.num_draft_tokens == 0
        llm.engine.shutdown()

    def test_greedy_identity_under_chunked_prefill_preemption_and_arrivals(self, tiny_model_path) -> None:
        """More requests than the batch holds (arrivals into a running batch), prompt chunks of
        8 tokens, and a KV cache too small for all of them (preemption and recompute): greedy
        tokens still equal plain decoding's under the same stack, and no block leaks."""
        sections = {
            "allocator": {"name": "paged", "block_size": 4, "num_blocks": 40},
            "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 8},
        }
        prompts = [*self.prompts, *(p[::-1] for p in self.prompts)]
        ref_llm = reference_llm(tiny_stack(tiny_model_path, **sections))
        preempted = ref_llm.get_stats().num_preemptions
        theirs = greedy(ref_llm, prompts, self.max_tokens)
        assert ref_llm.get_stats().num_preemptions > preempted, "kit: this stack should preempt"
        llm = kit_llm(self, tiny_model_path, **sections)
        ours = greedy(llm, prompts, self.max_tokens)
        for prompt, a, b in zip(prompts, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, (
                f"prompt {prompt!r} under preemption and chunked prefill: greedy tokens with the "
                f"speculator {a.token_ids} differ from plain decoding's {b.token_ids}"
            )
        alloc = llm.engine.allocator
        assert alloc.num_free_blocks() == alloc.num_blocks, "KV blocks leaked"
        llm.engine.shutdown()

    def test_greedy_identity_over_a_prefix_cache(self, tiny_model_path) -> None:
        """Prompts whose first blocks come from the prefix cache: greedy tokens equal plain
        decoding's. Skipped where no `prefix` cache is installed (lmstack-prefix-cache)."""
        import pytest

        from lmstack.stack.plugins import build_registry, make_plugin_manager

        if "prefix" not in build_registry(make_plugin_manager()).names("cache"):
            pytest.skip("no `prefix` cache installed (pip install lmstack-prefix-cache)")
        llm = kit_llm(self, tiny_model_path, cache={"name": "prefix"})
        opening = "one two three four five six seven eight nine ten eleven twelve " * 3  # > 2 blocks
        greedy(llm, [opening + "and so on"], self.max_tokens)  # the opening's blocks are cached now
        prompts = [opening + p for p in self.prompts]
        ours = greedy(llm, prompts, self.max_tokens)
        assert all(o.num_cached_tokens > 0 for o in ours), "kit: these prompts should hit the prefix cache"
        theirs = greedy(reference_llm(tiny_stack(tiny_model_path)), prompts, self.max_tokens)
        for prompt, a, b in zip(prompts, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, (
                f"prompt {prompt!r} over a cached prefix: greedy tokens with the speculator "
                f"{a.token_ids} differ from plain decoding's {b.token_ids}"
            )
        llm.engine.shutdown()

    def test_logprobs_stops_and_samples_compose(self, tiny_model_path) -> None:
        """Per-token logprobs equal plain decoding's; a stop string and a max_tokens that land
        inside a draft end the output where plain decoding ends it; n = 2 greedy samples both
        equal plain decoding's."""
        llm = kit_llm(self, tiny_model_path)
        ref = reference_llm(tiny_stack(tiny_model_path))
        prompts = list(self.prompts)
        ours = greedy(llm, prompts, self.max_tokens, logprobs=2)
        theirs = greedy(ref, prompts, self.max_tokens, logprobs=2)
        for prompt, a, b in zip(prompts, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, f"prompt {prompt!r}: tokens differ with logprobs on"
            for pos, (la, lb) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)):
                assert la.keys() == lb.keys(), f"prompt {prompt!r}, token {pos}: top logprobs differ"
                for tok in la:
                    assert abs(la[tok] - lb[tok]) < 1e-4, (
                        f"prompt {prompt!r}, token {pos}: logprob of {tok} {la[tok]} != {lb[tok]}"
                    )
        for prompt, plain in zip(prompts, theirs, strict=True):
            text = plain.text
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            if len(stop.strip()) < 2:
                continue
            a = greedy(llm, [prompt], self.max_tokens, stop=[stop])[0]
            b = greedy(ref, [prompt], self.max_tokens, stop=[stop])[0]
            assert (a.text, a.finish_reason) == (b.text, b.finish_reason), f"stop {stop!r} on {prompt!r}"
            odd = greedy(llm, [prompt], 7)[0]
            assert odd.token_ids == plain.token_ids[:7], f"max_tokens=7 on {prompt!r}"
        from lmstack.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, n=2, ignore_eos=True)
        (pair,) = generate(llm, prompts[-1:], params)
        assert len(pair.outputs) == 2
        for sample in pair.outputs:
            assert sample.token_ids == theirs[-1].token_ids, "n = 2 greedy samples differ from plain decoding"
        llm.engine.shutdown()
