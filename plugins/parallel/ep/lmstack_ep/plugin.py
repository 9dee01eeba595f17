"""Registers the `ep` parallel layout: `parallel: {name: ep, ep: N}` runs N worker processes,
each holding 1/N of every mixture-of-experts layer's experts (and the dense layers whole);
`tp: M` also splits each expert, and the dense layers, over M ranks inside each ep rank."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks
from lmstack.exec.parallel_layout import ShardedLayout
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext
from lmstack.registry import Component
from lmstack_ep.layout import check_cache_tiers, check_expert_parallel


class EpOptions(msgspec.Struct, forbid_unknown_fields=True):
    ep: Annotated[int, msgspec.Meta(description="ranks the experts are split over")] = 2
    tp: Annotated[
        int, msgspec.Meta(description="ranks each expert (and dense layer) is split over, inside an ep rank")
    ] = 1

    def __post_init__(self) -> None:
        for axis in ("ep", "tp"):
            if getattr(self, axis) < 1:
                raise ConfigError(
                    f"expected a positive integer, got {getattr(self, axis)}", f"parallel.{axis}"
                )


def build(options: EpOptions, ctx: BuildContext) -> ShardedLayout:
    # The model config is known here, before any worker starts or any weight loads.
    check_expert_parallel(options.ep, options.tp, ctx)
    return ShardedLayout(ParallelRanks(tp=options.tp, ep=options.ep))


def check(options: EpOptions, stack, key: str) -> str | None:
    return check_cache_tiers(options.tp, stack)


def _capabilities(options: EpOptions) -> dict:
    return {"devices": ("cpu", "cuda"), "world_size": options.ep * options.tp}


COMPONENT = Component(
    name="ep",
    kind="parallel",
    factory=build,
    options_type=EpOptions,
    description="Expert parallelism: a mixture-of-experts model's experts split over ep worker processes (x tp).",
    capabilities={"devices": ("cpu", "cuda"), "world_size": 2},
    capabilities_for=_capabilities,
    check=check,
    api=">=1.0,<2",  # the lmstack plugin APIs it is written against (lmstack.plugin_api)
)


@hookimpl
def lmstack_register_parallel(register):
    register(COMPONENT)
