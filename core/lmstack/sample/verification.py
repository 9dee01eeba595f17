"""Verification of speculative drafts: rejection sampling that keeps the target distribution.

For draft token x proposed from draft distribution q, with p the target's distribution at that
position (after the request's own processing: grammar mask, penalties, temperature, top-k/p):
accept x with probability min(1, p(x) / q(x)); on rejection draw from normalize(max(0, p - q))
and stop. If every draft is accepted, one bonus token is drawn from the target at the position
after the last draft. The emitted tokens are then distributed exactly as p (Leviathan et al.,
2023, "Fast Inference from Transformers via Speculative Decoding", Theorem 1).

A deterministic drafter (n-gram lookup, a greedy draft model) has q one-hot at x, so the rule
becomes: accept with probability p(x), on rejection draw from p with x removed. Greedy requests
accept while the draft equals the target's argmax and otherwise take the argmax, which makes the
output identical to decoding without drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmstack.model.layer_ops import argmax_rows
from lmstack.sample.sampler import Sampled, Sampler, SampleRow, needs_processing


@dataclass
class Draft:
    """One sequence's proposal: k draft tokens and, from a drafter that samples, the
    distribution each was drawn from."""

    token_ids: list[int]
    # [k, V]: row j is the distribution token_ids[j] was sampled from. None for a deterministic
    # drafter (q is one-hot at the proposed token).
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise ValueError(
                f"draft probs must have shape [k={len(self.token_ids)}, vocab], got {tuple(self.probs.shape)}"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, k: int) -> Draft:
        """The first `k` drafts (the engine never drafts past max_tokens or the context)."""
        k = max(0, k)
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k])


@dataclass
class Verification:
    """The outcome for one sequence."""

    # Accepted drafts followed by one token from the target (a correction or the bonus token);
    # empty when `error` is set.
    tokens: list[Sampled]
    num_accepted: int  # drafts accepted: 0..k
    error: str | None = None  # the request's own processing (grammar, logits processor) failed


# The sample row of the position that follows `extra` accepted tokens: penalties, processors and
# the grammar state see the sequence as it would be had those tokens been decoded one by one.
RowFor = Callable[[list[int]], SampleRow]


class RejectionSampler:
    """Verifies one sequence's drafts against the target's logits at the drafted positions."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, draft: Draft, row_for: RowFor) -> Verification:
        """logits: [k + 1, V] raw target rows: row j predicts the token after draft j - 1 (row 0
        follows the sequence's newest token, row k follows the last draft)."""
        k = len(draft)
        if logits.shape[0] != k + 1:
            raise ValueError(f"expected {k + 1} logits rows for {k} drafts, got {logits.shape[0]}")
        first = row_for([])
        if first.params.greedy and first.params.logprobs is None and not needs_processing(first):
            return self._verify_greedy(logits, draft)
        accepted: list[Sampled] = []
        for j, x in enumerate(draft.token_ids):
            row = row_for([s.token_id for s in accepted]) if j else first
            lg = self.sampler.process(logits[j : j + 1], [row])[0]
            if row.error is not None:
                return Verification([], 0, row.error)
            params = row.params
            p = self.sampler.probs(lg, params)
            logprobs = torch.log_softmax(lg, -1) if params.logprobs is not None else None
            if params.greedy:
                if p[x] > 0:
                    accepted.append(Sampler.with_logprobs(x, logprobs, params.logprobs or 0))
                    continue
                tok = int(lg.argmax())
            else:
                q = None if draft.probs is None else draft.probs[j].to(p.device, torch.float32)
                gen = self._generator(row)
                if float(torch.rand((), generator=gen)) < self._accept_probability(p, q, x):
                    accepted.append(Sampler.with_logprobs(x, logprobs, params.logprobs or 0))
                    continue
                tok = self._draw_residual(p, q, x, gen)
            accepted.append(Sampler.with_logprobs(tok, logprobs, params.logprobs or 0))
            return Verification(accepted, j)
        row = row_for([s.token_id for s in accepted])
        bonus = self.sampler.sample(logits[k : k + 1], [row])[0]
        if row.error is not None:
            return Verification([], 0, row.error)
        return Verification([*accepted, bonus], k)

    @staticmethod
    def _verify_greedy(logits: torch.Tensor, draft: Draft) -> Verification:
        """The general walk's outcome for a greedy row that nothing processes (no grammar,
        processor, penalty, min_tokens or logprobs; none of them can start further along a
        draft): one argmax over all k + 1 rows, then the drafts accepted while they equal it.
        Per row the walk took two scalar argmaxes of the vocabulary and a one-hot of it (~0.1 ms
        a row on a CPU, a step's few percent at batch 1)."""
        best = argmax_rows(logits.float()).tolist()
        accepted: list[Sampled] = []
        for j, x in enumerate(draft.token_ids):
            if x != best[j]:
                return Verification([*accepted, Sampled(best[j], 0.0)], j)
            accepted.append(Sampled(x, 0.0))
        return Verification([*accepted, Sampled(best[-1], 0.0)], len(accepted))

    def _generator(self, row: SampleRow) -> torch.Generator:
        # A seeded request draws from a stream keyed by (seed, sample, output position), so its
        # accept/reject decisions do not depend on the batch or on other requests.
        if row.params.seed is None:
            return self.sampler.generator
        key = hash((row.params.seed, row.sample_index, row.num_output)) & 0x7FFFFFFF
        return torch.Generator().manual_seed(key)

    @staticmethod
    def _accept_probability(p: torch.Tensor, q: torch.Tensor | None, x: int) -> float:
        qx = 1.0 if q is None else float(q[x])
        if qx <= 0.0:  # the drafter claims it could not have drawn x: nothing to correct for
            return 1.0
        return min(1.0, float(p[x]) / qx)

    @staticmethod
    def _draw_residual(p: torch.Tensor, q: torch.Tensor | None, x: int, gen: torch.Generator) -> int:
        if q is None:
            residual = p.clone()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q (up to rounding): rejection had probability ~0; p is exact
            residual, total = p, float(p.sum())
        return int(torch.multinomial((residual / total).cpu(), 1, generator=gen))
