"""Choosing a step's tokens: one sample per plain row, rejection sampling per drafted one.

Holds each sequence's grammar state, so every sample row (plain or at a draft position) sees
the sequence's structured-output position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmstack.sample.grammar import GrammarState
from lmstack.sample.sampler import Sampler, SampleRow
from lmstack.sample.verification import Draft, RejectionSampler, Verification
from lmstack.sequence import Sequence


@dataclass
class Choice:
    """A sequence to choose tokens for, and where its logits rows start."""

    seq: Sequence
    logits_index: int
    draft: Draft | None = None  # verified against rows logits_index .. + len(draft)


class StepSampler:
    def __init__(self, sampler: Sampler, verifier: RejectionSampler) -> None:
        self.sampler = sampler
        self.verifier = verifier
        self._grammars: dict[int, GrammarState] = {}  # seq_id -> its walk through its grammar

    def add(self, seq: Sequence) -> None:
        grammar = seq.request.params.grammar
        if grammar is not None:  # every sample, n > 1 forks included, walks the grammar alone
            self._grammars[seq.seq_id] = grammar.new_state()

    def drop(self, seq: Sequence) -> None:
        self._grammars.pop(seq.seq_id, None)

    def row(self, seq: Sequence, extra: list[int] | None = None) -> SampleRow:
        """The sample row for the position after `seq`'s tokens plus `extra` (drafts accepted
        so far). The grammar state syncs itself to the tokens (accept, roll back or replay)."""
        req = seq.request
        tokens = seq.token_ids + extra if extra else seq.token_ids  # read-only for the sampler
        grammar = self._grammars.get(seq.seq_id)
        return SampleRow(req.params, tokens, seq.prompt_len, seq.index, req.stop_ids, grammar=grammar)

    def choose(self, choices: list[Choice], logits: torch.Tensor) -> list[Verification]:
        """One result per choice, in order. Plain rows are sampled as one batch; a plain row's
        result carries its single token and num_accepted 0."""
        results: list[Verification | None] = [None] * len(choices)
        plain = [i for i, c in enumerate(choices) if not c.draft]
        for i, c in enumerate(choices):
            if c.draft:
                rows = logits[c.logits_index : c.logits_index + len(c.draft) + 1]
                results[i] = self.verifier.verify(rows, c.draft, lambda extra, s=c.seq: self.row(s, extra))
        if plain:
            index = [choices[i].logits_index for i in plain]
            sample_rows = [self.row(choices[i].seq) for i in plain]
            sampled = self.sampler.sample(_rows(logits, index), sample_rows)
            for i, s, r in zip(plain, sampled, sample_rows, strict=True):
                # A request's own processor failing ends only that request.
                results[i] = Verification([], 0, r.error) if r.error is not None else Verification([s], 0)
        return [r for r in results if r is not None]


def _rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits[index]; a view when the rows are consecutive (a decode batch: all of them), not a
    copy of [rows, vocab] per step. The sampler never writes into the tensor it is given."""
    first = index[0]
    if index == list(range(first, first + len(index))):
        return logits[first : first + len(index)]
    return logits[torch.tensor(index, device=logits.device)]
