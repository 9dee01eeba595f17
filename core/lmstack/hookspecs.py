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

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

from lmstack.roles import KINDS

if TYPE_CHECKING:
    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.model.architecture import ModelArchitecture
    from lmstack.outputs import EngineStats, RequestOutput
    from lmstack.registry import Component, StackSection

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
def lmstack_register_caches(register: Register) -> None:
    """Register KV caches (kind ``cache``, interface `lmstack.interfaces.BlockCache`): prefix
    reuse of full blocks across requests, and lower tiers (host memory, disk) that blocks move
    to and come back from."""


@hookspec
def lmstack_register_models(register: Callable[[ModelArchitecture], None]) -> None:
    """Register model architectures (`lmstack.model.architecture.ModelArchitecture`): the names a
    checkpoint uses for one, its config parser, model class and checkpoint-name mapping. Not a
    stack-selected kind: the checkpoint's architecture picks the model."""


# ---------------------------------------------------------------------------------------------
# Extending the stack file and the command line (how lmstack-api adds `server:` and `serve`).
# ---------------------------------------------------------------------------------------------


@hookspec
def lmstack_register_stack_sections(register: Callable[[StackSection], None]) -> None:
    """Declare top-level stack-file sections this plugin owns (``register(StackSection(...))``).
    The core validates them when a stack is resolved; an undeclared section is an error."""


@hookspec
def lmstack_register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to ``lmstack``: ``p = subparsers.add_parser("serve", help=...)``, then
    ``p.set_defaults(handler=fn)``; ``fn(args)`` returns the exit status. An `LmstackError` it
    raises is printed as one line."""


# ---------------------------------------------------------------------------------------------
# Lifecycle observers. They run on the engine's thread: keep them cheap, never block.
# ---------------------------------------------------------------------------------------------


@hookspec
def lmstack_engine_started(engine: LLMEngine) -> None:
    """The engine has built its components, loaded the weights and allocated the KV cache."""


@hookspec
def lmstack_step_finished(engine: LLMEngine, stats: EngineStats) -> None:
    """One engine step finished. `stats` is a snapshot of the engine's counters (queue depth,
    running sequences, KV usage, tokens so far, ...): a copy of its own, which later steps
    leave as it is, so a plugin may keep it."""


@hookspec
def lmstack_request_finished(engine: LLMEngine, output: RequestOutput) -> None:
    """A request finished (stopped, hit its length limit, failed or was aborted). `output` is
    its final output: every sequence's text and tokens, the finish reasons, the timings."""


REGISTRATION_HOOKS: dict[str, str] = {k.name: k.hook for k in KINDS}
"""Component kind -> the hook that registers it (from `lmstack.roles`)."""
