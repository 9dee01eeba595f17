"""The hooks a plugin may implement.

Registration hooks hand the plugin a `register` callback so that one plugin can offer several
components and the core knows which plugin offered which. Lifecycle hooks are observers: they
let a plugin add metrics or logging without touching the engine.

A plugin is any module or object with functions marked `@hookimpl`, named like the specs below::

    from lmstack.hookspecs import hookimpl
    from lmstack.registry import Component

    @hookimpl
    def lmstack_register_schedulers(register):
        register(Component(name="mine", kind="scheduler", factory=build))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from lmstack.model.architecture import ModelArchitecture
    from lmstack.registry import Component

PROJECT = "lmstack"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[["Component"], None]
"""The callback a registration hook receives: call it once per component offered."""


# ---------------------------------------------------------------------------------------------
# Registration: one hook per component kind. The component's `kind` must match the hook.
# ---------------------------------------------------------------------------------------------


@hookspec
def lmstack_register_schedulers(register: Register) -> None:
    """Register schedulers (kind ``scheduler``): they pick, each step, which sequences run and
    how many tokens each computes."""


@hookspec
def lmstack_register_allocators(register: Register) -> None:
    """Register KV-cache allocators (kind ``allocator``): they own the cache blocks and the
    block tables."""


@hookspec
def lmstack_register_attention(register: Register) -> None:
    """Register attention kernels (kind ``attention``) over the paged KV layout. A stack may
    pick different kernels for prefill and decode; declare the phases a kernel handles in the
    ``phases`` capability."""


@hookspec
def lmstack_register_quantizers(register: Register) -> None:
    """Register quantizers (kind ``quantizer``): how weights (and optionally the KV cache) are
    stored, and the matching linear ops."""


@hookspec
def lmstack_register_speculators(register: Register) -> None:
    """Register speculators (kind ``speculator``): they propose draft tokens that the core
    verifies losslessly."""


@hookspec
def lmstack_register_parallel(register: Register) -> None:
    """Register parallel layouts (kind ``parallel``): how the model is sharded over ranks
    (tensor, pipeline, expert parallelism) and the collectives it uses."""


@hookspec
def lmstack_register_models(register: Callable[[ModelArchitecture], None]) -> None:
    """Register model architectures (`lmstack.model.architecture.ModelArchitecture`): the names a
    checkpoint uses for one, its config parser, model class and checkpoint-name mapping. Not a
    stack-selected kind: the checkpoint's architecture picks the model."""


# ---------------------------------------------------------------------------------------------
# Lifecycle observers. They run on the engine's thread: keep them cheap, never block.
# ---------------------------------------------------------------------------------------------


@hookspec
def lmstack_engine_started(engine: Any) -> None:
    """The engine has built its components, loaded the weights and allocated the KV cache."""


@hookspec
def lmstack_step_finished(engine: Any, stats: Any) -> None:
    """One engine step finished. `stats` is a metrics snapshot (queue depth, running
    sequences, KV usage, tokens computed in the step, ...); treat it as read-only."""


@hookspec
def lmstack_request_finished(engine: Any, output: Any) -> None:
    """A request finished (stopped, hit its length limit, or was aborted). `output` is its
    final output object."""


REGISTRATION_HOOKS: dict[str, str] = {
    "scheduler": "lmstack_register_schedulers",
    "allocator": "lmstack_register_allocators",
    "attention": "lmstack_register_attention",
    "quantizer": "lmstack_register_quantizers",
    "speculator": "lmstack_register_speculators",
    "parallel": "lmstack_register_parallel",
}
"""Component kind -> the hook that registers it."""
