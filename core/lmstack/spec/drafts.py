"""The drafts in flight: how many drafts each decoding sequence may have this step (the
adaptive draft length, `lmstack.spec.draft_policy`), what the speculator proposed, trimmed to what
the request may still emit, kept until the step that verifies it; then what became of them,
back to the policy and the speculator."""

from __future__ import annotations

import time
from collections import Counter

import torch

from lmstack.engine.output_processor import OutputProcessor
from lmstack.engine.step_cost import StepCostModel
from lmstack.interfaces import DraftFeedback, Speculator
from lmstack.sample.verification import Draft
from lmstack.sequence import Sequence
from lmstack.spec.draft_policy import DraftLengthPolicy


class DraftBook:
    def __init__(
        self,
        outputs: OutputProcessor,
        speculator: Speculator | None = None,
    ) -> None:
        self.outputs = outputs
        self._drafts: dict[int, Draft] = {}  # seq_id -> the proposal behind seq.draft_token_ids
        k = speculator.num_draft_tokens if speculator is not None else 0
        adaptive = bool(getattr(speculator, "adaptive", True))
        # The policy's own cost model: only the steps that decode (no prefill chunk), timed from
        # before the drafting (`step_timed`).
        self.policy = DraftLengthPolicy(k, adaptive=adaptive, cost=StepCostModel())
        self._decode_only = False  # this step's scheduled work was decoding only
        self._propose_seconds = 0.0  # this step's time in the speculator's propose
        self.feedback: list[DraftFeedback] = []  # this step's, for Speculator.observe
        # Verifications by number of drafts accepted (a metric: the accepted-length histogram).
        self.accepted_lengths: Counter[int] = Counter()

    def propose(self, speculator: Speculator, running: list[Sequence]) -> None:
        """Ask for drafts for the sequences in decode that the policy allows some; each becomes
        `seq.draft_token_ids`, which the scheduler schedules as a multi-token query."""
        if not speculator.num_draft_tokens:
            return
        # Read each step: the engine's speculator may be swapped (tests, a reconfigured engine).
        self.policy.max_draft_tokens = speculator.num_draft_tokens
        self.policy.adaptive = bool(getattr(speculator, "adaptive", True))
        self.policy.confidence = bool(getattr(speculator, "stops_by_confidence", False))
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        self._decode_only = False
        self._propose_seconds = 0.0
        if not decoding:
            self.policy.last_mean_limit = 0.0
            return
        prefill_tokens = sum(s.num_uncomputed_tokens for s in running if s.num_uncomputed_tokens > 1)
        self._decode_only = prefill_tokens == 0
        limits = self.policy.limits([s.seq_id for s in decoding], prefill_tokens)
        asked = []
        for seq in decoding:
            # Never draft past max_tokens or the context: the step adds one token of its own.
            seq.draft_limit = max(0, min(limits[seq.seq_id], self.outputs.room(seq) - 1))
            seq.draft_min_gain = self.policy.min_gain
            seq.draft_token_ids = []
            if seq.draft_limit:
                asked.append(seq)
        if not asked:
            return
        started = time.perf_counter()
        proposals = speculator.propose(asked)
        self._propose_seconds = time.perf_counter() - started
        drafted = 0  # tokens proposed, and by how many sequences: what the time bought
        drafting_seqs = 0
        for seq in asked:
            got = proposals.get(seq.seq_id, [])
            draft = (got if isinstance(got, Draft) else Draft(list(got))).truncated(seq.draft_limit)
            seq.draft_token_ids = list(draft.token_ids)
            self._drafts[seq.seq_id] = draft
            drafted += len(draft)
            drafting_seqs += bool(len(draft))
        first = min(max(float(getattr(speculator, "first_draft_seconds", 0.0)), 0.0), self._propose_seconds)
        self.policy.record_drafting(drafted, self._propose_seconds, drafting_seqs, first)

    def take(self, seq: Sequence, scheduled: list[int]) -> Draft:
        """The proposal behind the drafts scheduled for `seq` this step (with the drafter's
        probabilities if it gave them); a plain deterministic draft if they no longer match."""
        draft = self._drafts.pop(seq.seq_id, None)
        return draft if draft is not None and draft.token_ids == scheduled else Draft(list(scheduled))

    def verified(
        self,
        seq: Sequence,
        num_drafted: int,
        num_accepted: int,
        new_token_ids: list[int],
        hidden_states: dict[int, torch.Tensor],
        first_position: int,
    ) -> None:
        """Record one sampled sequence's outcome (drafted or not) for this step's feedback."""
        if num_drafted:
            self.policy.record_verification(seq.seq_id, num_drafted, num_accepted)
            self.accepted_lengths[num_accepted] += 1
        self.feedback.append(
            DraftFeedback(seq, num_drafted, num_accepted, new_token_ids, hidden_states, first_position)
        )

    def step_timed(self, num_tokens: int, seconds: float) -> None:
        """The step (drafting included) ran `num_tokens` query tokens in `seconds`; the policy
        prices drafting apart (`record_drafting`), so it gets the step without it."""
        if self._decode_only:
            self.policy.record_step(num_tokens, max(seconds - self._propose_seconds, 1e-9))

    def step_done(self, speculator: Speculator) -> None:
        """The step is over: hand the speculator its feedback."""
        feedback, self.feedback = self.feedback, []
        if feedback and speculator.num_draft_tokens:
            speculator.observe(feedback)

    def drop(self, seq: Sequence) -> None:
        self._drafts.pop(seq.seq_id, None)
        self.policy.forget(seq.seq_id)
