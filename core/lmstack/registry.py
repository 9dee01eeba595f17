"""What the core knows about every installed component: name, kind, origin, capabilities, options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from lmstack.errors import ResolutionError
from lmstack.roles import KIND_NAMES, check_capabilities

KINDS = KIND_NAMES


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options struct for components that take none."""


@dataclass(frozen=True)
class Component:
    """One registered component.

    `factory(options, ctx)` builds the instance; `options` is an instance of `options_type`
    (a msgspec Struct with ``forbid_unknown_fields=True``) and `ctx` a `BuildContext`.

    `capabilities` says what the component supports (see `lmstack.resolve` for the keys the
    core checks), `requires` what it needs from the rest of the stack.

    Two optional hooks cover what a static mapping cannot say:

    - `capabilities_for(options)`: the capabilities under these (converted) options, when an
      option changes them (an opt-in that widens the devices); `capabilities` stays what
      `lmstack plugins` lists and what the default options give;
    - `check(options, stack, key)`: a conflict with the resolved stack in the component's own
      words, or None. `key` is where the stack names the component (``attention.prefill``); the
      core prefixes the answer with the component's role, name and distribution, so it reads
      as one sentence: ``"needs a CUDA device, but the stack sets device: cpu; use ..."``.
    """

    name: str
    kind: str
    factory: Callable[..., Any]
    options_type: type[msgspec.Struct] = NoOptions
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    requires: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    distribution: str = ""
    version: str = ""
    capabilities_for: Callable[[Any], Mapping[str, Any]] | None = None
    check: Callable[[Any, Any, str], str | None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"component {self.name!r}: unknown kind {self.kind!r}, expected one of {KINDS}")
        # A misspelled capability would otherwise restrict nothing, silently.
        check_capabilities(self.kind, self.capabilities, f"{self.kind} {self.name!r}")

    @property
    def option_names(self) -> list[str]:
        return list(self.options_type.__struct_fields__)


@dataclass(frozen=True)
class StackSection:
    """A top-level section of the stack file that a plugin declares and owns, e.g. lmstack-api's
    ``server:``. The core parses it into `type` (a msgspec Struct with
    ``forbid_unknown_fields=True``) when the stack is resolved; a stack without the section gets
    `type()`'s defaults.

    `public(value)` is what the section shows to readers of the resolved stack (``lmstack check
    --json``, the API's ``/v1/stack``): leave secrets out there. Without it, the whole value."""

    name: str
    type: type[msgspec.Struct]
    description: str = ""
    public: Callable[[Any], Any] | None = None
    distribution: str = ""
    version: str = ""


class Registry:
    """All components, by kind and name, and the stack sections plugins declare. Filled once by
    the plugin manager."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Component]] = {k: {} for k in KINDS}
        self.sections: dict[str, StackSection] = {}

    def add_section(self, section: StackSection, distribution: str = "", version: str = "") -> None:
        from lmstack.config import CORE_KEYS  # config imports this module's neighbours; keep it lazy

        if distribution and not section.distribution:
            section = replace(section, distribution=distribution, version=version)
        if section.name in CORE_KEYS:
            raise ResolutionError(
                f"{section.distribution or 'a plugin'} declares stack section {section.name!r}, which "
                "the core owns; pick another name"
            )
        old = self.sections.get(section.name)
        if old is not None:
            raise ResolutionError(
                f"stack section {section.name!r} is declared twice: by {old.distribution or 'unknown'} "
                f"and by {section.distribution or 'unknown'}; uninstall one of them"
            )
        self.sections[section.name] = section

    def add(self, component: Component, distribution: str = "", version: str = "") -> None:
        if distribution and not component.distribution:
            component = replace(component, distribution=distribution, version=version)
        table = self._by_kind[component.kind]
        old = table.get(component.name)
        if old is not None:
            raise ResolutionError(
                f"{component.kind} {component.name!r} is registered twice: by "
                f"{old.distribution or 'unknown'} and by {component.distribution or 'unknown'}; "
                "uninstall one of them or disable it with LMSTACK_PLUGINS"
            )
        table[component.name] = component

    def get(self, kind: str, name: str) -> Component:
        table = self._by_kind[kind]
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise ResolutionError(
                f"unknown {kind} {name!r}; installed {kind} components: {known} "
                "(run `lmstack plugins` to list them with their packages)"
            )
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])

    def all(self) -> list[Component]:
        return [c for k in KINDS for c in sorted(self._by_kind[k].values(), key=lambda c: c.name)]
