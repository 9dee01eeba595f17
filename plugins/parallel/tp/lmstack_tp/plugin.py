"""Registers the `tp` parallel layout: `parallel: {name: tp, tp: N}` runs N worker processes,
each holding 1/N of every decoder layer's heads and MLP and of the vocabulary."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks
from lmstack.exec.parallel_layout import ShardedLayout, check_tensor_parallel
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.registry import Component

# Which plugin shards along the other axes (this one accepts them at 1 only).
_OTHER_AXES = {"pp": "the `pp` plugin (pipeline parallelism)", "ep": "the `ep` plugin (expert parallelism)"}


class TpOptions(msgspec.Struct, forbid_unknown_fields=True):
    tp: Annotated[int, msgspec.Meta(description="ranks the model's tensors are split over")] = 2
    pp: Annotated[
        int, msgspec.Meta(description="pipeline stages: 1 (parallel.name: pp composes with tp)")
    ] = 1
    ep: Annotated[
        int,
        msgspec.Meta(description="expert-parallel ranks: 1 (parallel.name: ep composes with tp)"),
    ] = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"expected a positive integer, got {self.tp}", "parallel.tp")
        for axis, plugin in _OTHER_AXES.items():
            if getattr(self, axis) != 1:
                raise ConfigError(
                    f"the `tp` layout splits tensors only (got {axis}={getattr(self, axis)}); "
                    f"{plugin} composes with tp: set parallel.name to it",
                    f"parallel.{axis}",
                )


def build(options: TpOptions, ctx: BuildContext) -> ShardedLayout:
    # The model config and the quantizer are known here, before any worker starts or weight loads.
    check_tensor_parallel(options.tp, ctx.model_config, ctx.components.get("quantizer"))
    return ShardedLayout(ParallelRanks(tp=options.tp))


def check(options: TpOptions, stack, key: str) -> str | None:
    # A lower cache tier swaps KV blocks out through worker rank 0, which holds only its own
    # heads: the other ranks' share would be lost.
    tiers = tuple(stack.cache.capabilities.get("tiers") or ("device",))
    if options.tp > 1 and tiers != ("device",):
        return (
            f"keeps each rank's KV heads on its own device, but cache {stack.cache.name!r} moves "
            f"blocks to {', '.join(t for t in tiers if t != 'device')}; use a device-only cache "
            "(cache: prefix or none) with tp"
        )
    return None


COMPONENT = Component(
    name="tp",
    kind="parallel",
    factory=build,
    options_type=TpOptions,
    description="Tensor parallelism: attention heads, MLP and vocabulary split over tp worker processes.",
    capabilities={"devices": ("cpu", "cuda"), "world_size": 2},
    capabilities_for=lambda options: {"devices": ("cpu", "cuda"), "world_size": options.tp},
    check=check,
    api=">=1.0,<2",  # the lmstack plugin APIs it is written against (lmstack.plugin_api)
)


@hookimpl
def lmstack_register_parallel(register):
    register(COMPONENT)
