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

    `capabilities` says what the component supports (see `lmstack.stack.resolve` for the keys the
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

    def option_docs(self) -> list[OptionDoc]:
        """Every option with its type, default, allowed values and description."""
        return describe_options(self.options_type)

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


# ---------------------------------------------------------------------------------------------
# Options, described for `lmstack plugins`
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionDoc:
    """One option of a component (or key of a stack section) as `lmstack plugins` shows it.

    Everything is read from the options Struct: the type and default from the field, the
    allowed values from a ``Literal`` / ``enum.Enum`` type or ``msgspec.Meta`` bounds, and the
    description from ``msgspec.Meta(description=...)``::

        class MyOptions(msgspec.Struct, forbid_unknown_fields=True):
            tile: Annotated[int, msgspec.Meta(ge=16, le=256, description="keys per tile")] = 64

    The same metadata is what ``msgspec.json.schema`` puts into a JSON schema."""

    name: str  # nested Struct fields are dotted: ``rate_limit.requests_per_minute``
    type: str  # ``int``, ``int | null``, ``float | 'auto'``, ``list[str | ApiKey]``
    default: Any = None  # JSON-able; meaningless when `required`
    required: bool = False
    choices: tuple[Any, ...] = ()  # the values a Literal / Enum allows
    bounds: Mapping[str, Any] = field(default_factory=dict)  # ge, gt, le, lt, min_length, pattern ...
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "default": self.default,
            "required": self.required,
            "choices": list(self.choices),
            "bounds": dict(self.bounds),
            "description": self.description,
        }


_BOUND_KEYS = ("ge", "gt", "le", "lt", "multiple_of", "min_length", "max_length", "pattern")


def describe_options(options_type: type, prefix: str = "") -> list[OptionDoc]:
    """The fields of a msgspec Struct as `OptionDoc`s, in declaration order. A field that is
    itself a Struct (a sub-section such as ``slo:``) is listed as its own fields, dotted."""
    info = msgspec.inspect.type_info(options_type)
    if not isinstance(info, msgspec.inspect.StructType):
        return []
    docs: list[OptionDoc] = []
    for f in info.fields:
        name = prefix + f.encode_name
        inner = f.type.type if isinstance(f.type, msgspec.inspect.Metadata) else f.type
        if isinstance(inner, msgspec.inspect.StructType) and not f.required:
            docs.extend(describe_options(inner.cls, prefix=f"{name}."))
            continue
        members = _members(f.type)
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = None
        docs.append(
            OptionDoc(
                name=name,
                type=_type_name(f.type),
                default=msgspec.to_builtins(default, str_keys=True, enc_hook=repr),
                required=f.required,
                choices=tuple(v for m in members for v in _choices(m)),
                bounds={
                    k: getattr(m, k) for m in members for k in _BOUND_KEYS if getattr(m, k, None) is not None
                },
                description=_description(f.type),
            )
        )
    return docs


def _members(info: Any) -> list[Any]:
    """The alternatives of a (possibly annotated) type, each without its Metadata wrapper."""
    info = _bare(info)
    types = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return [_bare(t) for t in types]


def _bare(info: Any) -> Any:
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    return info


def _description(info: Any) -> str:
    """``Meta(description=...)`` on the field's type, or on the one member of an Optional that
    carries it (``Annotated[int, Meta(...)] | None``)."""
    candidates = [info]
    bare = _bare(info)
    if isinstance(bare, msgspec.inspect.UnionType):
        candidates += list(bare.types)
    for candidate in candidates:
        while isinstance(candidate, msgspec.inspect.Metadata):
            text = (candidate.extra_json_schema or {}).get("description")
            if text:
                return str(text)
            candidate = candidate.type
    return ""


def _choices(info: Any) -> tuple[Any, ...]:
    if isinstance(info, msgspec.inspect.LiteralType):
        return tuple(info.values)
    if isinstance(info, msgspec.inspect.EnumType):
        return tuple(member.value for member in info.cls)
    return ()


_SCALAR_NAMES = {
    msgspec.inspect.IntType: "int",
    msgspec.inspect.FloatType: "float",
    msgspec.inspect.BoolType: "bool",
    msgspec.inspect.StrType: "str",
    msgspec.inspect.NoneType: "null",  # what the stack file (YAML) writes
    msgspec.inspect.AnyType: "any",
}


def _type_name(info: Any) -> str:
    """A readable name of a msgspec type. A Literal alone reads as its values' type (the
    allowed values are listed beside it); inside a union with other types it is spelled out,
    ``float | 'auto'``, so the type says what else is accepted."""
    members = _members(info)
    alone = len([m for m in members if not isinstance(m, msgspec.inspect.NoneType)]) == 1
    names: list[str] = []
    for member in members:
        if isinstance(member, msgspec.inspect.LiteralType | msgspec.inspect.EnumType):
            values = _choices(member)
            if alone:
                spelled = sorted({type(v).__name__ for v in values})
            else:
                spelled = [repr(v) for v in values]
        else:
            spelled = [_one_type_name(member)]
        names.extend(n for n in spelled if n not in names)
    return " | ".join(names)


def _one_type_name(info: Any) -> str:
    for cls, name in _SCALAR_NAMES.items():
        if isinstance(info, cls):
            return name
    if isinstance(info, msgspec.inspect.ListType | msgspec.inspect.VarTupleType | msgspec.inspect.SetType):
        return f"list[{_type_name(info.item_type)}]"
    if isinstance(info, msgspec.inspect.DictType):
        return f"dict[{_type_name(info.key_type)}, {_type_name(info.value_type)}]"
    if isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType):
        return info.cls.__name__
    # Everything else (bytes, datetimes, tuples of fixed length...) by msgspec's own class name.
    return type(info).__name__.removesuffix("Type").lower()


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

    def option_docs(self) -> list[OptionDoc]:
        """Every key of the section (nested ones dotted: ``slo.ttft_ms``), described."""
        return describe_options(self.type)


@dataclass(frozen=True)
class Extension:
    """Something a plugin registered through a registration hook another plugin owns (lmstack-api's
    `lmstack_register_tool_parsers`): the core lists it (`lmstack plugins`) and knows where it
    came from; the owning plugin uses `obj` (`Registry.extensions[hook]`). `kind` is the owner's
    word for it ("tool parser"), `name` the object's ``name`` attribute."""

    hook: str
    kind: str
    name: str
    obj: Any
    description: str = ""
    distribution: str = ""
    version: str = ""


class Registry:
    """All components, by kind and name, and the stack sections plugins declare. Filled once by
    the plugin manager."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Component]] = {k: {} for k in KINDS}
        self.sections: dict[str, StackSection] = {}
        # Hook name -> what plugins registered through it, in registration order (built-ins first).
        self.extensions: dict[str, list[Extension]] = {}
        # Plugins skipped (or suspect) while the registry was filled: `lmstack plugins --check`
        # lists them, and an unknown component name mentions them (one may have provided it).
        self.problems: list[PluginProblem] = []

    def add_section(self, section: StackSection, distribution: str = "", version: str = "") -> None:
        from lmstack.stack.config import CORE_KEYS  # config imports this module's neighbours; keep it lazy

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

    def add_extension(self, item: Extension) -> None:
        items = self.extensions.setdefault(item.hook, [])
        old = next((e for e in items if e.name == item.name), None)
        if old is not None:
            raise ResolutionError(
                f"{item.kind} {item.name!r} is registered twice: by {old.distribution or 'unknown'} "
                f"and by {item.distribution or 'unknown'}; uninstall one of them or disable it with "
                "LMSTACK_PLUGINS"
            )
        items.append(item)

    def discard(self, kind: str, name: str) -> None:
        """Take a component out again (a plugin found broken after it registered some)."""
        self._by_kind[kind].pop(name, None)

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])

    def all(self) -> list[Component]:
        return [c for k in KINDS for c in sorted(self._by_kind[k].values(), key=lambda c: c.name)]
