"""The drafts in flight: what the speculator proposed for each decoding sequence, trimmed to
what the request may still emit, kept until the step that verifies it."""

from __future__ import annotations

from lmstack.interfaces import Speculator
from lmstack.output_processor import OutputProcessor
from lmstack.sequence import Sequence
from lmstack.verification import Draft


class DraftBook:
    def __init__(self, outputs: OutputProcessor) -> None:
        self.outputs = outputs
        self._drafts: dict[int, Draft] = {}  # seq_id -> the proposal behind seq.draft_token_ids

    def propose(self, speculator: Speculator, running: list[Sequence]) -> None:
        """Ask for drafts for the sequences in decode; each becomes `seq.draft_token_ids`, which
        the scheduler schedules as a multi-token query."""
        if not speculator.num_draft_tokens:
            return
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        if not decoding:
            return
        proposals = speculator.propose(decoding)
        for seq in decoding:
            got = proposals.get(seq.seq_id, [])
            draft = got if isinstance(got, Draft) else Draft(list(got))
            # Never draft past max_tokens or the context: the step adds one token of its own.
            draft = draft.truncated(self.outputs.room(seq) - 1)
            seq.draft_token_ids = list(draft.token_ids)
            self._drafts[seq.seq_id] = draft

    def take(self, seq: Sequence, scheduled: list[int]) -> Draft:
        """The proposal behind the drafts scheduled for `seq` this step (with the drafter's
        probabilities if it gave them); a plain deterministic draft if they no longer match."""
        draft = self._drafts.pop(seq.seq_id, None)
        return draft if draft is not None and draft.token_ids == scheduled else Draft(list(scheduled))

    def drop(self, seq: Sequence) -> None:
        self._drafts.pop(seq.seq_id, None)
