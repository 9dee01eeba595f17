"""Registers the `pp` parallel layout: `parallel: {name: pp, pp: 2, micro_batches: 4, tp: 1}`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks
from lmstack.exec.executor import ExecutorSpec
from lmstack.exec.parallel_layout import ShardedLayout, check_tensor_parallel
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext, Executor
from lmstack.registry import Component
from lmstack_pp.stage import StageExecutor


class PipelineOptions(msgspec.Struct, forbid_unknown_fields=True):
    pp: Annotated[int, msgspec.Meta(description="pipeline stages, one process each (times tp)")] = 2
    micro_batches: Annotated[
        int, msgspec.Meta(description="micro-batches a step is split into (0: as many as stages)")
    ] = 0
    tp: Annotated[
        int, msgspec.Meta(description="tensor-parallel ranks per stage (uses the tp plugin's layers)")
    ] = 1

    def __post_init__(self) -> None:
        for name in ("pp", "micro_batches", "tp"):
            value = getattr(self, name)
            if value < (0 if name == "micro_batches" else 1):
                raise ConfigError(f"expected a positive integer, got {value!r}", f"parallel.{name}")


class PipelineLayout(ShardedLayout):
    """`pp x tp` workers; each runs a `StageExecutor` (its stage of every micro-batch)."""

    def __init__(self, options: PipelineOptions) -> None:
        super().__init__(ParallelRanks(tp=options.tp, pp=options.pp))
        self.options = options

    def create_executor(self, spec: ExecutorSpec) -> Executor:
        from lmstack.exec.multiproc import MultiprocExecutor

        local = functools.partial(StageExecutor, micro_batches=self.options.micro_batches)
        spec = dataclasses.replace(spec, parallel=self.ranks)
        return MultiprocExecutor(spec, self.world_size, local_executor=local)


def build(options: PipelineOptions, ctx: BuildContext) -> PipelineLayout:
    mc = ctx.model_config
    if mc is not None and options.pp > mc.num_layers:
        raise ConfigError(
            f"pp={options.pp} stages for a model with {mc.num_layers} decoder layers (at most {mc.num_layers})",
            "parallel.pp",
        )
    check_tensor_parallel(options.tp, ctx.model_config, ctx.components.get("quantizer"))
    if ctx.kv_cache_dtype.is_floating_point and ctx.kv_cache_dtype.itemsize == 1:
        # Scales come from a calibration forward over the whole model, which no stage holds.
        raise ConfigError(
            f"pp does not support a scaled {ctx.kv_cache_dtype} KV cache yet; "
            "set quant.kv_cache to the model dtype, or use tp",
            "quant.kv_cache",
        )
    return PipelineLayout(options)


CAPABILITIES = {"devices": ("cpu", "cuda"), "world_size": 2}  # world_size under the default options

COMPONENT = Component(
    name="pp",
    kind="parallel",
    factory=build,
    options_type=PipelineOptions,
    description="Pipeline parallelism: decoder layers split into stages, micro-batches in flight.",
    capabilities=CAPABILITIES,
    capabilities_for=lambda options: {**CAPABILITIES, "world_size": options.pp * options.tp},
    api=">=1.0,<2",
)


@hookimpl
def lmstack_register_parallel(register):
    register(COMPONENT)
