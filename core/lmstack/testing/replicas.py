"""`replicas`: a test-only parallel layout. N ranks over torch.distributed, each holding the full
model (no sharding), driven by `MultiprocExecutor` — the plumbing every real layout builds on:
spawning or joining ranks, broadcasting commands, noticing a rank that died.

This module is a plugin: add it with ``make_plugin_manager(extra_plugins=["lmstack.testing.replicas"])``,
or run ``python -m lmstack.testing.replicas serve STACK`` (the `lmstack` command with it added;
what the multi-process server tests and `benchmarks/e2e/parallel.py` start, also under torchrun).
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec

from lmstack.hookspecs import hookimpl
from lmstack.interfaces import Executor, ParallelLayout
from lmstack.registry import Component


class ReplicasOptions(msgspec.Struct, forbid_unknown_fields=True):
    world_size: Annotated[int, msgspec.Meta(description="processes, each holding the full model")] = 2
    join_timeout_s: Annotated[
        float, msgspec.Meta(description="seconds to wait for the ranks to join before giving up")
    ] = 60.0


class ReplicasLayout(ParallelLayout):
    def __init__(self, options: ReplicasOptions) -> None:
        self.world_size = options.world_size
        self.join_timeout = options.join_timeout_s

    def create_executor(self, spec) -> Executor:
        from lmstack.exec.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, self.world_size, join_timeout=self.join_timeout)


COMPONENT = Component(
    name="replicas",
    kind="parallel",
    factory=lambda options, ctx: ReplicasLayout(options),
    options_type=ReplicasOptions,
    description="Test layout: N full replicas over torch.distributed (no sharding).",
    capabilities={"devices": ("cpu", "cuda")},
)


@hookimpl
def lmstack_register_parallel(register) -> None:
    register(COMPONENT)


def main(argv: list[str] | None = None) -> int:
    """`lmstack` with this plugin added (for subprocesses and torchrun, which cannot take a
    plugin object)."""
    import lmstack.stack.plugins as plugins
    from lmstack.cli import main as cli_main

    make = plugins.make_plugin_manager

    def with_replicas(**kw):
        extra = [*kw.pop("extra_plugins", ()), "lmstack.testing.replicas"]
        return make(extra_plugins=extra, **kw)

    plugins.make_plugin_manager = with_replicas
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
