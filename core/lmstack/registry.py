"""What the core knows about every installed component: name, kind, origin, capabilities, options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from lmstack.errors import ResolutionError
from lmstack.plugin_api import PLUGIN_API_VERSION
from lmstack.roles import KIND_NAMES, check_capabilities

KINDS = KIND_NAMES


class InvalidComponent(ValueError):
    """A `Component` that cannot work as declared (options type, capabilities, API range); the
    message names the component and the fix."""


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
    # The lmstack plugin APIs this component works with, a PEP 440 specifier set such as
    # ">=1.0,<2" (see lmstack.plugin_api); empty: not declared (accepted).
    api: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidComponent(
                f"component {self.name!r}: unknown kind {self.kind!r}, expected one of {KINDS}"
            )
        who = f"{self.kind} {self.name!r}"
        try:
            # A misspelled capability would otherwise restrict nothing, silently.
            check_capabilities(self.kind, self.capabilities, who)
        except ValueError as exc:
            raise InvalidComponent(str(exc)) from None
        _check_options_type(self.options_type, who)
        if self.api:
            try:
                SpecifierSet(self.api)
            except InvalidSpecifier:
                raise InvalidComponent(
                    f"{who}: api={self.api!r} is not a version range; write a PEP 440 specifier set "
                    f"such as '>={PLUGIN_API_VERSION},<{int(PLUGIN_API_VERSION.split('.')[0]) + 1}'"
                ) from None

    @property
    def option_names(self) -> list[str]:
        return list(getattr(self.options_type, "__struct_fields__", ()))

    def api_mismatch(self) -> str | None:
        """Why this lmstack cannot load the component (its `api` range excludes
        `PLUGIN_API_VERSION`), or None when it can."""
        if not self.api or SpecifierSet(self.api).contains(PLUGIN_API_VERSION, prereleases=True):
            return None
        origin = " ".join(p for p in (self.distribution, self.version) if p) or "unknown distribution"
        dist = self.distribution or "plugin"
        return (
            f"{self.kind} {self.name!r} ({origin}) supports lmstack plugin API {self.api}, this lmstack "
            f"provides {PLUGIN_API_VERSION}; upgrade lmstack or install a {dist} release for API "
            f"{PLUGIN_API_VERSION}"
        )


def _check_options_type(options_type: Any, who: str) -> None:
    # The core converts a stack's options with msgspec and lists them from the struct's fields;
    # without forbid_unknown_fields a misspelled option would be dropped silently, so that is
    # an error too, not a warning.
    name = getattr(options_type, "__name__", repr(options_type))
    fix = f"class {name}(msgspec.Struct, forbid_unknown_fields=True)"
    if not (isinstance(options_type, type) and issubclass(options_type, msgspec.Struct)):
        if isinstance(options_type, type) and is_dataclass(options_type):
            got = f"dataclass {name}"
        elif isinstance(options_type, type):
            got = f"class {name}"
        else:
            got = f"{type(options_type).__name__} {options_type!r}"
        raise InvalidComponent(f"{who}: options_type must be a msgspec.Struct ({fix}); got {got}")
    if not options_type.__struct_config__.forbid_unknown_fields:
        raise InvalidComponent(
            f"{who}: options_type {name} must forbid unknown fields, or a misspelled option in a "
            f"stack file is silently ignored; declare it as {fix}"
        )


@dataclass(frozen=True)
class PluginProblem:
    """A plugin that could not be loaded, or loaded but is suspect. `message` continues
    ``plugin 'name' (distribution version) ...``; `skipped` says whether its components were
    left out; `offered` lists the (kind, name) components it tried to register."""

    plugin: str
    distribution: str
    version: str
    message: str
    skipped: bool = True
    offered: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        origin = " ".join(p for p in (self.distribution, self.version) if p) or "unknown distribution"
        return f"plugin {self.plugin!r} ({origin}) {self.message}"


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
        # Plugins skipped (or suspect) while the registry was filled: `lmstack plugins --check`
        # lists them, and an unknown component name mentions them (one may have provided it).
        self.problems: list[PluginProblem] = []

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
            for problem in self.problems:
                if (kind, name) in problem.offered:
                    raise ResolutionError(f"{kind} {name!r} is not available: {problem}")
            known = ", ".join(sorted(table)) or "none"
            broken = ""
            if self.problems:
                broken = "; plugins with problems, which may provide it: " + "; ".join(
                    str(p) for p in self.problems
                )
            raise ResolutionError(
                f"unknown {kind} {name!r}; installed {kind} components: {known} "
                f"(run `lmstack plugins` to list them with their packages){broken}"
            )
        return table[name]

    def discard(self, kind: str, name: str) -> None:
        """Take a component out again (a plugin found broken after it registered some)."""
        self._by_kind[kind].pop(name, None)

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])

    def all(self) -> list[Component]:
        return [c for k in KINDS for c in sorted(self._by_kind[k].values(), key=lambda c: c.name)]
