"""`none`: no speculative decoding — one token per decode step."""

from __future__ import annotations

from lmstack.interfaces import Speculator
from lmstack.registry import Component
from lmstack.sequence import Sequence


class NoSpeculator(Speculator):
    num_draft_tokens = 0

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        return {}


COMPONENT = Component(
    name="none",
    kind="speculator",
    factory=lambda options, ctx: NoSpeculator(),
    description="Plain decoding.",
    capabilities={"devices": ("cpu", "cuda", "mps")},
)
