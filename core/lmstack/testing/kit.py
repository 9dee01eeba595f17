"""What every conformance kit shares: naming the component under test, building it through its
registered factory, reading its declared capabilities, and running it inside a real engine on
the tiny test model.

A kit is a pytest class (its name does not start with ``Test``, so it is not collected itself);
a plugin's test module subclasses it and names the component::

    class TestMine(SchedulerConformance):
        component = "mine"               # a registered name, or the Component object
        options = {"max_num_seqs": 8}    # optional, converted through its options_type
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from lmstack.hookspecs import REGISTRATION_HOOKS, hookimpl
from lmstack.registry import Component
from lmstack.roles import ROLES
from lmstack.testing.components import (
    build_component,
    convert_options,
    declared_capabilities,
    lookup,
)


class ComponentKit:
    """Base of the kits. `kind` is set by each kit; a subclass sets `component` (and `options`)."""

    kind: ClassVar[str] = ""
    component: ClassVar[str | Component | None] = None
    options: ClassVar[Mapping[str, Any]] = {}

    # --- the component under test ------------------------------------------------------------

    def registered(self) -> Component:
        return lookup(self.component, self.kind)  # type: ignore[arg-type]

    def converted_options(self, **overrides: Any) -> Any:
        return convert_options(self.registered(), {**self.options, **overrides})

    def capabilities(self, **overrides: Any) -> dict[str, Any]:
        """The declared capabilities under the kit's options (plus `overrides`)."""
        return declared_capabilities(self.registered(), self.converted_options(**overrides))

    def build(self, overrides: Mapping[str, Any] | None = None, **ctx_parts: Any) -> Any:
        """The instance, built through the registered factory with the kit's options updated by
        `overrides` (only those the options type has: the kit passes sizes it needs, such as a
        scheduler's token budget, when the component takes them)."""
        comp = self.registered()
        extra = {k: v for k, v in (overrides or {}).items() if k in comp.option_names}
        return build_component(comp, self.kind, {**self.options, **extra}, **ctx_parts)

    def narrowed(self, attribute: str, declared: Iterable[Any] | None, default: Iterable[Any]) -> tuple:
        """The test matrix along one axis: the class attribute `attribute` when set (it must be
        a subset of what the component declares), else the declared values, else `default`."""
        chosen = getattr(self, attribute, None)
        if chosen is None:
            return tuple(declared if declared is not None else default)
        chosen = tuple(chosen)
        if declared is not None:
            extra = [v for v in chosen if v not in tuple(declared)]
            assert not extra, (
                f"{type(self).__name__}.{attribute} = {chosen} tests {extra}, which "
                f"{self.kind} {self.registered().name!r} does not declare (declared: {tuple(declared)}); "
                "narrow the attribute to declared values or declare them"
            )
        return chosen

    # --- checks every kind shares ------------------------------------------------------------------

    def test_registered_component_builds(self) -> None:
        """The kit's options convert through the options type (the registry has already refused
        one that is not a msgspec Struct forbidding unknown fields), the declared capabilities
        are valid, and the factory builds an instance of the kind's interface."""
        comp = self.registered()
        assert comp.kind == self.kind
        self.capabilities()
        self.build()


# --- running a component inside the engine on the tiny model ------------------------------------


class _OneComponent:
    """A plugin object registering one component (for a Component object the kit was given)."""

    def __init__(self, component: Component) -> None:
        self.component = component
        hook = REGISTRATION_HOOKS[component.kind]

        def register_it(register) -> None:
            register(self.component)

        setattr(self, hook, hookimpl(register_it))


def plugin_manager_for(component: Component):
    """(plugin manager, name) under which a stack can select `component`: the default one when
    it is the registered component of that name, else one with the component added (renamed if
    an installed component already has its name)."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    pm = make_plugin_manager()
    registry = build_registry(pm)
    names = registry.names(component.kind)
    if component.name in names:
        installed = registry.get(component.kind, component.name)
        if installed.factory is component.factory and installed.options_type is component.options_type:
            return pm, component.name
    name = component.name if component.name not in names else f"{component.name}-under-test"
    return make_plugin_manager(extra_plugins=[_OneComponent(replace(component, name=name))]), name


def section_for(kind: str, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The stack-file entry selecting `name` with `options` for a single-role kind."""
    (role,) = [r for r in ROLES if r.kind == kind]
    section, _, key = role.key.partition(".")
    return {section: {key: name, **options}}


_REFERENCE_ENGINES: dict[str, Any] = {}


def reference_llm(stack: Mapping[str, Any]):
    """An `LLM` with only built-in components, shared for the session per distinct stack."""
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    key = json.dumps(stack, sort_keys=True, default=str)
    if key not in _REFERENCE_ENGINES:
        _REFERENCE_ENGINES[key] = LLM(dict(stack), plugin_manager=make_plugin_manager(autoload=False))
    return _REFERENCE_ENGINES[key]


def tiny_stack(model_path: str | Path, **sections: Any) -> dict[str, Any]:
    """A small stack on the tiny model (fp32, CPU, a few KV blocks)."""
    return {
        "model": str(model_path),
        "dtype": "float32",
        "device": "cpu",
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 64},
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 128},
        **sections,
    }


def kit_llm(kit: ComponentKit, model_path: str | Path, **sections: Any):
    """An `LLM` on the tiny model with the kit's component selected under the kit's options."""
    from lmstack.engine.llm import LLM

    pm, name = plugin_manager_for(kit.registered())
    stack = tiny_stack(model_path, **sections)
    stack.update(section_for(kit.kind, name, kit.options))
    return LLM(stack, plugin_manager=pm)


@contextlib.contextmanager
def one_thread():
    """Torch on one thread while the tiny model runs: its matmuls are too small to split, and on
    a busy machine waiting for a second thread cost 10x the math (25 s vs 2 s measured)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def generate(llm, prompts: list[str], params: Any) -> list[Any]:
    with one_thread():
        return llm.generate(list(prompts), params)


def greedy(llm, prompts: list[str], max_tokens: int, **params: Any) -> list[Any]:
    from lmstack.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return generate(llm, prompts, sp)


# Prompts for end-to-end checks: ordinary text, and repetitive text (where a drafter that looks
# the continuation up in the context proposes most, so verification runs).
KIT_PROMPTS = (
    "the cat sat on the mat",
    "in the beginning there was the word, and the word was in the beginning",
    "one two one two one two one two one two one two",
    "abcabcabcabcabcabcabc",
)
