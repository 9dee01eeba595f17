"""Registers the speculator `ngram` (imported whenever lmstack loads plugins: keep it light)."""

from __future__ import annotations

from lmstack.hookspecs import hookimpl
from lmstack.registry import Component
from lmstack_ngram.speculator import NgramOptions, NgramSpeculator


def build(options: NgramOptions, ctx) -> NgramSpeculator:
    return NgramSpeculator(options)


COMPONENT = Component(
    name="ngram",
    kind="speculator",
    factory=build,
    options_type=NgramOptions,
    # Pure Python over token ids: runs beside any device's model.
    capabilities={"devices": ("cpu", "cuda", "mps")},
    requires={"allocator.truncate": True},
    description="Prompt lookup: drafts what followed the latest earlier occurrence of the sequence's suffix.",
    api=">=1.3,<2",
)


@hookimpl
def lmstack_register_speculators(register) -> None:
    register(COMPONENT)
