"""Registers the speculator `eagle` and the command `lmstack eagle` (imported whenever lmstack
loads plugins: keep it light; torch-heavy pieces load in the factory and the command)."""

from __future__ import annotations

from lmstack.hookspecs import hookimpl
from lmstack.registry import Component
from lmstack_eagle.speculator import EagleOptions, build, int8_kernel_problem


def check(options: EagleOptions, stack: object, key: str) -> str | None:
    """An int8 head needs lmstack-int8's kernel (the device is `capabilities_for`'s)."""
    return int8_kernel_problem() if options.head_weights == "int8" else None


COMPONENT = Component(
    name="eagle",
    kind="speculator",
    factory=build,
    options_type=EagleOptions,
    # The head runs in-process beside the target, on its device.
    capabilities={"devices": ("cpu", "cuda", "mps")},
    # An int8 head runs lmstack-int8's CPU kernel.
    capabilities_for=lambda options: {
        "devices": ("cpu",) if options.head_weights == "int8" else ("cpu", "cuda", "mps")
    },
    check=check,
    requires={"allocator.truncate": True},
    description="EAGLE-1 draft head: one decoder layer over the target's final hidden states.",
    api=">=1.6,<2",
)


@hookimpl
def lmstack_register_speculators(register) -> None:
    register(COMPONENT)


@hookimpl
def lmstack_register_commands(subparsers) -> None:
    from lmstack_eagle.train import add_command

    add_command(subparsers)
