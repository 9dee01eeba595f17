"""Example third-party lmstack plugin: speculator `suffix`, a prompt-lookup drafter.

Text often repeats itself: code quotes its own identifiers, answers quote the prompt, lists
repeat their structure. This drafter needs no draft model: it takes the last few tokens of a
sequence (its suffix), finds the most recent earlier place where those tokens occurred in the same
sequence (prompt and output so far), and proposes the tokens that followed them there. The core
verifies every draft against the model in the next step, so the output is exactly what plain
decoding would give; only the number of model steps changes.

Kept small on purpose, to show the speculator seam: the search below is a linear scan per step.
A production n-gram drafter (an index that stays incremental as tokens arrive) is a plugin of its
own.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext, Speculator
from lmstack.registry import Component
from lmstack.sequence import Sequence

__all__ = ["COMPONENT", "SuffixOptions", "SuffixSpeculator", "lmstack_register_speculators"]


class SuffixOptions(msgspec.Struct, forbid_unknown_fields=True):
    # The longest and shortest suffix looked up; longer matches are tried first (they predict
    # better), shorter ones only when no longer one occurred.
    max_ngram: Annotated[
        int, msgspec.Meta(description="longest suffix looked up, in tokens (tried first)")
    ] = 3
    min_ngram: Annotated[int, msgspec.Meta(description="shortest suffix looked up, in tokens")] = 1
    # The most tokens proposed per step: each costs a query token in the verifying step.
    num_draft_tokens: Annotated[
        int, msgspec.Meta(description="the most tokens proposed per step (each costs a query token)")
    ] = 4

    def __post_init__(self) -> None:
        if self.min_ngram < 1:
            raise ConfigError(f"must be >= 1, got {self.min_ngram}", "speculator.min_ngram")
        if self.max_ngram < self.min_ngram:
            raise ConfigError(
                f"must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}", "speculator.max_ngram"
            )
        if self.num_draft_tokens < 1:
            raise ConfigError(f"must be >= 1, got {self.num_draft_tokens}", "speculator.num_draft_tokens")


class SuffixSpeculator(Speculator):
    def __init__(self, options: SuffixOptions) -> None:
        self.max_ngram = options.max_ngram
        self.min_ngram = options.min_ngram
        # The engine reads this: the most tokens `propose` returns for one sequence (0: never asks).
        self.num_draft_tokens = options.num_draft_tokens

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        # Called once per engine step with the sequences in decode; an empty list drafts nothing.
        return {seq.seq_id: self.draft(seq.token_ids) for seq in seqs}

    def draft(self, tokens: list[int]) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (prompt + output) that occurred before, at most `num_draft_tokens` of them."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # Latest first: recent text predicts the next tokens best. `start` stops before the
            # suffix itself, so at least one token follows every match.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + self.num_draft_tokens]
        return []


def build(options: SuffixOptions, ctx: BuildContext) -> SuffixSpeculator:
    return SuffixSpeculator(options)


COMPONENT = Component(
    name="suffix",
    kind="speculator",
    factory=build,
    options_type=SuffixOptions,
    # Pure Python over token ids: runs wherever the model runs.
    capabilities={"devices": ("cpu", "cuda", "mps")},
    description="Prompt lookup: drafts the tokens that followed the sequence's latest matching suffix (example plugin).",
    api=">=1.0,<2",
)


@hookimpl
def lmstack_register_speculators(register) -> None:
    register(COMPONENT)
