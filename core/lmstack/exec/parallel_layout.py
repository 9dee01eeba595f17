"""What the parallel plugins (`tp`, `pp`, `ep`) share: a layout that starts one worker process
per rank, each building its shard of the model, and the checks that a model splits over the
degrees a stack asks for. `lmstack.stack.resolve.check_model` runs the head / width check as soon as
the model's config is read; the layout's factory runs it again with the built quantizer's shard
alignment, before the executor exists: a bad degree fails before any worker starts or any
weight loads.

A plugin validates its own options, then returns `ShardedLayout(ParallelRanks(tp=..., pp=...,
ep=...))`; `lmstack.exec.multiproc` gives each worker its rank (`init_parallel`) and the model reads
it at build time (`lmstack.exec.distributed.get_parallel`).
"""

from __future__ import annotations

import dataclasses

from lmstack.errors import ResolutionError
from lmstack.exec.distributed import ParallelRanks
from lmstack.exec.executor import ExecutorSpec
from lmstack.interfaces import Executor, LinearSpec, ParallelLayout, Quantizer
from lmstack.model.config import ModelConfig
from lmstack.model.tensor_parallel import tp_problem, valid_tp_degrees


class ShardedLayout(ParallelLayout):
    """`ranks.world_size` worker processes over torch.distributed (gloo on CPU, NCCL on CUDA),
    each holding its shard of the model; worker rank 0 returns the step's outputs."""

    def __init__(self, ranks: ParallelRanks) -> None:
        self.ranks = ranks
        self.world_size = ranks.world_size

    def create_executor(self, spec: ExecutorSpec) -> Executor:
        from lmstack.exec.multiproc import MultiprocExecutor

        return MultiprocExecutor(dataclasses.replace(spec, parallel=self.ranks), self.world_size)


def _alignment(quantizer: Quantizer | None):
    if quantizer is None:
        return lambda spec: 1

    def alignment(spec: LinearSpec) -> int:
        return quantizer.shard_alignment(spec)

    return alignment


def check_tensor_parallel(
    tp: int, model_config: ModelConfig | None, quantizer: Quantizer | None = None, key: str = "parallel.tp"
) -> None:
    """ResolutionError when the model does not split over `tp` ranks — its heads, MLP width, or
    the quantizer's shard alignment (`Quantizer.shard_alignment`) — naming the degrees that
    would. Nothing to check without a model config (a factory built alone, in a test)."""
    mc = model_config
    if mc is None or tp == 1:
        return
    alignment = _alignment(quantizer)
    problem = tp_problem(mc, tp, alignment)
    if problem is None:
        return
    degrees = valid_tp_degrees(mc, alignment)
    ok = ", ".join(map(str, degrees[:-1])) + f" or {degrees[-1]}" if len(degrees) > 1 else str(degrees[0])
    model = f"model {mc.name!r}" if mc.name else "the model"
    raise ResolutionError(f"{key}: tp={tp} does not divide {model} ({problem}); tp can be {ok}")
