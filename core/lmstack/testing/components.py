"""Building a registered component the way the engine does: through its factory, with options
converted through its `options_type` and a realistic `BuildContext` for its kind.

The kits use this so that what they test is the `Component` a stack would select (a broken
factory or options type fails the kit), not a class the author wired up by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from lmstack import interfaces
from lmstack.components.paged import block_size_of
from lmstack.interfaces import BuildContext, EngineLimits
from lmstack.model.config import ModelConfig
from lmstack.registry import Component
from lmstack.roles import KIND, ROLES, check_capabilities

# The model config factories see when no model is loaded: the geometry of the tiny test model
# (`lmstack.testing.tiny_model`), so a component sized from it is small.
TINY_MODEL_CONFIG = ModelConfig(
    vocab_size=275,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    name="tiny",
)


def lookup(component: str | Component, kind: str) -> Component:
    """The component a kit tests: a `Component`, or the name of one in the registry a plain run
    sees (`lmstack.stack.plugins.default_registry()`: built-ins plus installed entry points)."""
    if isinstance(component, Component):
        assert component.kind == kind, (
            f"{component.kind} {component.name!r} was given to the {kind} kit; use the {component.kind} kit"
        )
        return component
    if not isinstance(component, str) or not component:
        raise AssertionError(
            f"set `component` on the {kind} kit subclass to a registered {kind} name or a Component, "
            f"got {component!r}"
        )
    return _default_registry().get(kind, component)


_REGISTRIES: dict[tuple[str, str], Any] = {}


def _default_registry():
    """`default_registry()`, built once per setting of the plugin environment switches (a kit
    looks its component up in every check)."""
    import os

    from lmstack.stack.plugins import ALLOW_LIST_ENV, AUTOLOAD_ENV, default_registry

    key = (os.environ.get(AUTOLOAD_ENV, ""), os.environ.get(ALLOW_LIST_ENV, ""))
    if key not in _REGISTRIES:
        _REGISTRIES[key] = default_registry()
    return _REGISTRIES[key]


def convert_options(component: Component, options: Mapping[str, Any] | None = None) -> Any:
    """`options` converted through the component's `options_type`, as the stack resolver does
    (the registry has checked that it is a msgspec Struct forbidding unknown fields)."""
    who = f"{component.kind} {component.name!r}"
    try:
        return msgspec.convert(dict(options or {}), component.options_type, strict=False)
    except Exception as exc:  # a validation error, or whatever the type's __post_init__ raises
        raise AssertionError(
            f"{who}: options {dict(options or {})!r} do not convert to {component.options_type.__name__}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def declared_capabilities(component: Component, options: Any) -> dict[str, Any]:
    """What the component declares under these converted options: `capabilities_for(options)`
    when it has one, else `capabilities`; checked against the kind's capability vocabulary."""
    caps = component.capabilities_for(options) if component.capabilities_for else component.capabilities
    try:
        check_capabilities(component.kind, caps, f"{component.kind} {component.name!r}")
    except ValueError as exc:
        raise AssertionError(str(exc)) from None
    return dict(caps)


def interface_of(kind: str) -> type:
    return getattr(interfaces, KIND[kind].interface)


# --- a BuildContext per kind ------------------------------------------------------------------


def _default_allocator(options: Any, ctx: BuildContext) -> None:
    if ctx.allocator is None:
        from lmstack.components.paged import PagedAllocator

        ctx.allocator = PagedAllocator(64, 4)


def _default_limits(options: Any, ctx: BuildContext) -> None:
    if ctx.limits is None:
        ctx.limits = EngineLimits(
            max_model_len=256,
            max_num_seqs=getattr(options, "max_num_seqs", 8),
            max_num_batched_tokens=getattr(options, "max_num_batched_tokens", 32),
        )


def _default_kv_bytes(options: Any, ctx: BuildContext) -> None:
    if ctx.kv_bytes_per_block is None and ctx.model_config is not None:
        block_size = block_size_of(options, ctx.device)
        ctx.kv_bytes_per_block = block_size * ctx.model_config.kv_bytes_per_token(ctx.kv_cache_dtype.itemsize)


def _earlier_components(kind: str, ctx: BuildContext) -> None:
    """`ctx.components`: for every role the engine builds before this kind's, the built-in
    default (the allocator already in the context stands for the allocator role)."""
    roles = [r.kind for r in ROLES]
    if kind not in roles:
        return
    builtins = _builtin_registry()
    made: dict[str, Any] = {}
    for role in ROLES[: roles.index(kind)]:
        if role.name in ctx.components:
            continue
        if role.kind == "allocator" and ctx.allocator is not None:
            ctx.components[role.name] = ctx.allocator
            continue
        comp = builtins.get(role.kind, role.default)
        if comp.name not in made or role.kind != "attention":  # one kernel fills both phases
            made[comp.name] = comp.factory(convert_options(comp), ctx)
        ctx.components[role.name] = made[comp.name]


@functools.cache
def _builtin_registry():
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    return build_registry(make_plugin_manager(autoload=False))


@dataclass(frozen=True)
class KitKind:
    """What building a component of a kind needs besides its options: the steps that fill the
    `BuildContext` as the engine would have by the time that kind's factory runs."""

    prepare: tuple[Callable[[Any, BuildContext], None], ...] = ()


# The engine builds in `lmstack.roles.ROLES` order; each kind gets what the roles before it put
# into the context. A new kind adds a row here (and a kit class).
KIT_KINDS: dict[str, KitKind] = {
    "quantizer": KitKind(),
    "attention": KitKind(),
    "parallel": KitKind(),
    "allocator": KitKind((_default_kv_bytes,)),
    "scheduler": KitKind((_default_allocator, _default_limits)),
    "speculator": KitKind((_default_allocator, _default_limits)),
}


def make_context(
    kind: str,
    options: Any = None,
    *,
    model_config: ModelConfig | None = TINY_MODEL_CONFIG,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: torch.dtype | None = None,
    **parts: Any,
) -> BuildContext:
    """A `BuildContext` as the engine fills it before building a `kind` component: the tiny
    model's config, and for a scheduler or speculator an allocator and `EngineLimits`, for an
    allocator `kv_bytes_per_block`; `components` holds the built-in default of every role built
    before it. `parts` (limits, allocator, kv_bytes_per_block, components) replace defaults."""
    ctx = BuildContext(model_config, torch.device(device), dtype, kv_cache_dtype or dtype)
    for name, value in parts.items():
        if not hasattr(ctx, name):
            raise TypeError(f"BuildContext has no field {name!r}")
        setattr(ctx, name, value)
    # A kind without a row gets a context with the model, device and dtypes only.
    for step in KIT_KINDS.get(kind, KitKind()).prepare:
        step(options, ctx)
    _earlier_components(kind, ctx)
    return ctx


def build_component(
    component: str | Component,
    kind: str,
    options: Mapping[str, Any] | None = None,
    *,
    ctx: BuildContext | None = None,
    **ctx_parts: Any,
) -> Any:
    """Build `component` (a Component or a registered name) through its factory, with `options`
    converted through its options type and `ctx` (default: `make_context(kind, ...)` with
    `ctx_parts`); assert the result implements the kind's interface from `lmstack.interfaces`."""
    comp = lookup(component, kind)
    opts = convert_options(comp, options)
    declared_capabilities(comp, opts)
    if ctx is None:
        ctx = make_context(kind, opts, **ctx_parts)
    who = f"{kind} {comp.name!r}" + (f" ({comp.distribution})" if comp.distribution else "")
    try:
        instance = comp.factory(opts, ctx)
    except Exception as exc:
        raise AssertionError(f"{who}: the factory raised {type(exc).__name__}: {exc}") from exc
    iface = interface_of(kind)
    assert isinstance(instance, iface), (
        f"{who}: the factory returned a {type(instance).__name__}, which is not an "
        f"lmstack.interfaces.{iface.__name__}; subclass it"
    )
    return instance
