"""Parallel-layout conformance: the layout serves the tiny model with the single-process
engine's greedy tokens, its world size is what it declares, and the engine shuts it down
cleanly (no worker process left, a second shutdown is harmless)."""

from __future__ import annotations

import multiprocessing
from typing import ClassVar

from lmstack.interfaces import Executor, ParallelLayout
from lmstack.testing.kit import KIT_PROMPTS, ComponentKit, greedy, kit_llm, reference_llm, tiny_stack


class ParallelConformance(ComponentKit):
    """Set `component` (a registered parallel layout name or Component) and optionally
    `options`."""

    kind = "parallel"
    max_tokens: ClassVar[int] = 12

    def test_world_size_as_declared(self) -> None:
        layout = self.build()
        assert isinstance(layout, ParallelLayout)
        declared = self.capabilities().get("world_size")
        assert isinstance(layout.world_size, int) and layout.world_size >= 1
        if declared is not None:
            assert layout.world_size == declared, (
                f"the layout declares world_size {declared}, its instance has {layout.world_size}"
            )

    def test_greedy_tokens_match_single_process_and_shutdown_is_clean(self, tiny_model_path) -> None:
        before = {p.pid for p in multiprocessing.active_children()}
        llm = kit_llm(self, tiny_model_path)
        try:
            executor = llm.engine.executor
            assert isinstance(executor, Executor)
            world = getattr(executor, "world_size", 1)
            assert world == llm.engine.parallel.world_size, (
                f"the layout's world_size is {llm.engine.parallel.world_size}, its executor runs {world} ranks"
            )
            ours = greedy(llm, list(KIT_PROMPTS), self.max_tokens)
        finally:
            llm.engine.shutdown()
        left = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert not left, f"{len(left)} worker processes still alive after shutdown: {left}"
        llm.engine.shutdown()  # idempotent
        theirs = greedy(reference_llm(tiny_stack(tiny_model_path)), list(KIT_PROMPTS), self.max_tokens)
        for prompt, a, b in zip(KIT_PROMPTS, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, (
                f"prompt {prompt!r}: greedy tokens {a.token_ids} under the layout, "
                f"{b.token_ids} in a single process"
            )
