"""The `ngram` speculator: one `NgramIndex` per sequence in decode.

Drafts are deterministic (the core verifies them as one-hot proposals: greedy output is
identical to plain decoding, sampled output keeps the target distribution). How many drafts a
sequence gets each step is the core's adaptive draft length (`lmstack.spec.draft_policy`), capped by
`num_draft_tokens`; a sequence whose suffix never occurred before gets none and costs nothing.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.interfaces import Speculator
from lmstack.sequence import Sequence
from lmstack_ngram.index import NgramIndex

PURGE_EVERY = 256  # steps between sweeps of finished sequences' indexes


class NgramOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Suffix lengths looked up, longest first: a longer match predicts better, a shorter one
    # is tried only when no longer one occurred.
    min_ngram: Annotated[int, msgspec.Meta(description="shortest suffix looked up, in tokens")] = 1
    max_ngram: Annotated[
        int, msgspec.Meta(description="longest suffix looked up, in tokens (tried first)")
    ] = 4
    # The most drafts per sequence per step.
    num_draft_tokens: Annotated[
        int, msgspec.Meta(description="the most draft tokens per sequence per step")
    ] = 5
    # Let the core size the draft per step from measured acceptance and step cost (down to 0
    # when the batch is compute-bound); false: always up to num_draft_tokens.
    adaptive: Annotated[
        bool,
        msgspec.Meta(description="let the core size the draft per step (false: always num_draft_tokens)"),
    ] = True

    def __post_init__(self) -> None:
        if self.min_ngram < 1:
            raise ConfigError(f"must be >= 1, got {self.min_ngram}", "speculator.min_ngram")
        if self.max_ngram < self.min_ngram:
            raise ConfigError(
                f"must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}", "speculator.max_ngram"
            )
        if not 1 <= self.num_draft_tokens <= 64:
            raise ConfigError(f"must be in 1..64, got {self.num_draft_tokens}", "speculator.num_draft_tokens")


class NgramSpeculator(Speculator):
    def __init__(self, options: NgramOptions) -> None:
        self.options = options
        self.num_draft_tokens = options.num_draft_tokens
        self.adaptive = options.adaptive
        self._indexes: dict[int, tuple[Sequence, NgramIndex]] = {}
        self._calls = 0

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        self._calls += 1
        if self._calls % PURGE_EVERY == 0:
            self._indexes = {k: v for k, v in self._indexes.items() if not v[0].is_finished}
        out: dict[int, list[int]] = {}
        for seq in seqs:
            entry = self._indexes.get(seq.seq_id)
            if entry is None:
                entry = self._indexes[seq.seq_id] = (
                    seq,
                    NgramIndex(self.options.min_ngram, self.options.max_ngram),
                )
            draft = entry[1].draft(seq.token_ids, seq.draft_limit or self.num_draft_tokens)
            if draft:
                out[seq.seq_id] = draft
        return out
