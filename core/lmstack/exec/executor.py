"""The executor seam: what drives the model, in-process or over worker processes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmstack.batch import ModelOutput, StepPlan
from lmstack.exec.distributed import ParallelRanks
from lmstack.exec.model_runner import ModelRunner
from lmstack.interfaces import AttentionBackend, Executor, Quantizer
from lmstack.model.architecture import ModelRegistry
from lmstack.model.config import ModelConfig


@dataclass
class ExecutorSpec:
    """Everything a worker needs to build its model runner. Picklable apart from the
    component instances, which a multi-process layout rebuilds in each worker from the
    resolved stack (`stack`)."""

    model: str  # name or path, resolved by lmstack.model.source
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    kv_cache_dtype: torch.dtype
    max_positions: int
    quantizer: Quantizer
    prefill: AttentionBackend
    decode: AttentionBackend
    stack: object = None  # lmstack.stack.resolve.ResolvedStack
    models: ModelRegistry | None = None  # the installed model architectures; None: the built-ins
    # The engine's open model source (`lmstack.model.source.ModelSource`), so this process opens
    # its model once; None: the executor opens `model` itself (a worker process does).
    source: object = None
    parallel: ParallelRanks | None = None  # a multi-process layout's degrees (workers set their rank)
    # How each rank of a multi-process layout builds its own executor (picklable; a pipeline
    # stage's, say); None: InProcessExecutor.
    rank_executor: Callable[[ExecutorSpec], Executor] | None = None


class InProcessExecutor(Executor):
    """Runs the model in the engine's own process (the `single` layout)."""

    def __init__(self, spec: ExecutorSpec) -> None:
        self.spec = spec
        self.runner: ModelRunner | None = None

    def load_model(self) -> None:
        from lmstack.model.source import open_model_source

        s = self.spec
        source = s.source if s.source is not None else open_model_source(s.model, models=s.models)
        self.runner = ModelRunner(
            s.model_config,
            source.architecture,
            source.weights(),
            dtype=s.dtype,
            device=s.device,
            quantizer=s.quantizer,
            prefill=s.prefill,
            decode=s.decode,
            kv_cache_dtype=s.kv_cache_dtype,
            max_positions=s.max_positions,
        )

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        if self.runner is not None:  # the loaded model's own share (a tensor-parallel rank's heads)
            return self.runner.kv_cache_bytes_per_block(block_size)
        return block_size * self.spec.model_config.kv_bytes_per_token(self.spec.kv_cache_dtype.itemsize)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        assert self.runner is not None
        self.runner.init_kv_cache(num_blocks, block_size)

    def execute(self, plan: StepPlan) -> ModelOutput:
        assert self.runner is not None, "load_model() first"
        return self.runner.execute(plan)

    def parameter_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per rank (here one): each parameter's name and shape as loaded — what a parallel
        layout's conformance test checks its shards against."""
        assert self.runner is not None, "load_model() first"
        return [{n: tuple(p.shape) for n, p in self.runner.model.named_parameters()}]
