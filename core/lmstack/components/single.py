"""`single`: one process, one device — the model runs inside the engine's process."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError
from lmstack.exec.executor import ExecutorSpec, InProcessExecutor
from lmstack.interfaces import Executor, ParallelLayout
from lmstack.registry import Component


class SingleOptions(msgspec.Struct, forbid_unknown_fields=True):
    tp: Annotated[
        int, msgspec.Meta(description="tensor-parallel ranks: 1 (install a parallel plugin for more)")
    ] = 1
    pp: Annotated[
        int, msgspec.Meta(description="pipeline stages: 1 (install a parallel plugin for more)")
    ] = 1
    ep: Annotated[
        int, msgspec.Meta(description="expert-parallel ranks: 1 (install a parallel plugin for more)")
    ] = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) != 1:
                raise ConfigError(
                    f"the built-in `single` layout runs on one device (got {name}={getattr(self, name)}); "
                    "install a parallel plugin and set parallel.name to it",
                    f"parallel.{name}",
                )


class SingleLayout(ParallelLayout):
    world_size = 1

    def create_executor(self, spec: ExecutorSpec) -> Executor:
        return InProcessExecutor(spec)


COMPONENT = Component(
    name="single",
    kind="parallel",
    factory=lambda options, ctx: SingleLayout(),
    options_type=SingleOptions,
    description="Single process, single device.",
    capabilities={"devices": ("cpu", "cuda", "mps"), "world_size": 1},
)
