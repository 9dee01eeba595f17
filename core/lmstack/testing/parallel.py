"""Parallel-layout conformance: the layout serves the tiny model with the single-process
engine's greedy tokens, its world size is what it declares, the engine shuts it down cleanly
(no worker process left, a second shutdown is harmless), each rank's parameters are pieces of
the model's that add up, and a killed worker makes the engine fail fast instead of hanging."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
from typing import ClassVar

import pytest

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

    # The bound on noticing a dead rank: generous for a loaded CI machine, far below a hang.
    dead_worker_bound_s: ClassVar[float] = 30.0

    @pytest.fixture(scope="class")
    @classmethod
    def layout_llm(cls, tiny_model_path):
        """One engine under the layout for the two tests below (building it is the slow part):
        the shard check reads it, then the dead-worker test (defined last) kills a worker.
        Yields (llm, the worker processes it started)."""
        before = {p.pid for p in multiprocessing.active_children()}
        llm = kit_llm(cls(), tiny_model_path)  # an instance: the kit reads class attributes only
        workers = [p for p in multiprocessing.active_children() if p.pid not in before]
        yield llm, workers
        llm.engine.shutdown()

    def test_shard_shapes_add_up(self, layout_llm, tiny_model_path) -> None:
        """Every rank's parameters (as loaded, reported by the executor's `parameter_shapes`)
        are pieces of the single-process model's: known names, the same rank, each dimension
        at most the whole one and at most one dimension split; every parameter is held
        somewhere, and its pieces add up to whole copies of it (one per replica group)."""
        executor = layout_llm[0].engine.executor
        if not hasattr(executor, "parameter_shapes"):
            pytest.skip(f"{type(executor).__name__} does not report parameter_shapes")
        ranks = executor.parameter_shapes()
        whole = reference_llm(tiny_stack(tiny_model_path)).engine.executor.parameter_shapes()[0]
        assert len(ranks) == getattr(executor, "world_size", 1), "one shape map per rank"
        held: dict[str, int] = dict.fromkeys(whole, 0)
        # A split that does not divide evenly (a vocabulary over tp ranks) may be padded: at
        # most one slice of padding per piece along its split dimension.
        slack: dict[str, int] = dict.fromkeys(whole, 0)
        for rank, shapes in enumerate(ranks):
            for name, shape in shapes.items():
                assert name in whole, f"rank {rank} holds {name!r}, which the model does not have"
                full = whole[name]
                assert len(shape) == len(full) and all(s <= f for s, f in zip(shape, full, strict=True)), (
                    f"rank {rank}: {name} has shape {shape}, not a piece of {full}"
                )
                split = [d for d, (s, f) in enumerate(zip(shape, full, strict=True)) if s != f]
                assert len(split) <= 1, f"rank {rank}: {name} {shape} of {full} is split along {split}"
                held[name] += math.prod(shape)
                if split:
                    slack[name] += math.prod(shape) // max(1, shape[split[0]])
        for name, total in held.items():
            size = math.prod(whole[name])
            assert total > 0, f"no rank holds {name}"
            copies, padding = divmod(total, size)
            assert copies >= 1 and padding <= slack[name] * max(1, copies), (
                f"the pieces of {name} {whole[name]} add up to {total} elements, not whole copies of {size}"
            )

    def test_dead_worker_does_not_hang_the_engine(self, layout_llm) -> None:
        """A worker process killed while requests run: the engine's step raises EngineDeadError
        within `dead_worker_bound_s` (never hangs), later calls raise at once, and shutdown
        returns."""
        from lmstack.errors import EngineDeadError
        from lmstack.sampling_params import SamplingParams

        llm, workers = layout_llm
        engine = llm.engine
        if not workers:
            pytest.skip("the layout started no worker process of its own to kill")
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                engine.add_request("the cat sat on the mat", SamplingParams(max_tokens=500, ignore_eos=True))
                engine.step()  # the prefill, before the kill
                os.kill(workers[-1].pid, signal.SIGKILL)
                while engine.has_unfinished():
                    engine.step()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(self.dead_worker_bound_s)
        try:
            assert outcome, f"the engine hung for {self.dead_worker_bound_s} s after a worker was killed"
            assert isinstance(outcome[0], EngineDeadError), (
                f"expected EngineDeadError after killing a worker, got {outcome[0]!r}"
            )
            with pytest.raises(EngineDeadError):
                engine.executor.execute(None)
        finally:
            done = threading.Event()
            threading.Thread(target=lambda: (engine.shutdown(), done.set()), daemon=True).start()
            assert done.wait(self.dead_worker_bound_s), "shutdown hung after a worker died"
        left = [p for p in workers if p.is_alive()]
        assert not left, f"{len(left)} worker processes still alive after shutdown"
