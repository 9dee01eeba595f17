"""Pipeline stages: which of a model's parameters one stage holds, and the checkpoint-name filter
that keeps a stage from loading (or even reading) the tensors of the others.

A stage holds decoder layers [start, end) (`lmstack.exec.distributed.layer_range`); the first stage
also embeds tokens and the last one holds the final norm and the LM head. With tied embeddings
and more than one stage the last stage has no embedding, so the embedding tensor is loaded into
its head instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmstack.model.weight_loader import ShardId

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class StageLayers:
    start: int
    end: int
    num_layers: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def param_name(
        self, target: tuple[str, ShardId | None] | None, *, tied: bool
    ) -> tuple[str, ShardId | None] | None:
        """Filter a model's (parameter name, shard id) mapping down to this stage: None for a
        parameter another stage holds; the embedding goes to the head on a last stage that does
        not embed when the embeddings are tied."""
        if target is None:
            return None
        name = target[0]
        if m := _LAYER.match(name):
            return target if self.holds(int(m.group(1))) else None
        if name.startswith("embed_tokens."):
            if self.first:
                return target
            if self.last and tied:
                return "lm_head." + name.removeprefix("embed_tokens."), target[1]
            return None
        if name.startswith(("norm.", "lm_head.")):
            return target if self.last else None
        return target
