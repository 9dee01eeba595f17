"""Finding plugins and filling the component registry from them.

Built-in components are registered through the same hooks as third-party ones, from the modules
in `DEFAULT_PLUGINS`. Third-party plugins are entry points in group ``lmstack``. Two environment
switches keep runs reproducible (tests must not depend on what happens to be installed):

- ``LMSTACK_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry-point plugins at all;
- ``LMSTACK_PLUGINS=a,b`` loads only the entry points named ``a`` and ``b``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

import pluggy

from lmstack import hookspecs
from lmstack.errors import LmstackError, ResolutionError
from lmstack.registry import KINDS, Component, Registry, StackSection

ENTRY_POINT_GROUP = "lmstack"
DEFAULT_PLUGINS: tuple[str, ...] = ("lmstack.components.builtins",)

AUTOLOAD_ENV = "LMSTACK_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_LIST_ENV = "LMSTACK_PLUGINS"

UNKNOWN_DISTRIBUTION = "<unknown>"
UNKNOWN_VERSION = "0+unknown"

_TRUE = {"1", "true", "yes", "on"}


def autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in _TRUE


def allow_list_from_env() -> frozenset[str] | None:
    """Entry-point names from ``LMSTACK_PLUGINS``; None when unset or empty (load all)."""
    raw = os.environ.get(ALLOW_LIST_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return names or None


def make_plugin_manager(
    *,
    autoload: bool | None = None,
    extra_plugins: Iterable[object | str] = (),
    allow: Iterable[str] | None = None,
    default_plugins: Iterable[str] | None = None,
) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, `extra_plugins`, then entry-point plugins.

    `autoload` / `allow` default to the environment switches. `extra_plugins` are plugin
    objects or importable module names (tests use them for fake plugins). `default_plugins`
    replaces `DEFAULT_PLUGINS` (tests that want only their fakes pass ``()``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)

    for module_name in DEFAULT_PLUGINS if default_plugins is None else tuple(default_plugins):
        # A built-in failing to import is a broken install, not a user error: let it raise.
        _register(pm, importlib.import_module(module_name), module_name)
    for plugin in extra_plugins:
        if isinstance(plugin, str):
            _register(pm, importlib.import_module(plugin), plugin)
        else:
            _register(pm, plugin, None)

    if autoload_enabled() if autoload is None else autoload:
        allowed = allow_list_from_env() if allow is None else frozenset(allow)
        _load_entry_points(pm, allowed)

    _check_hook_names(pm)
    return pm


def _register(pm: pluggy.PluginManager, plugin: object, name: str | None) -> None:
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise ResolutionError(f"plugin {name or _module_of(plugin)!r} cannot be registered: {exc}") from exc


def _load_entry_points(pm: pluggy.PluginManager, allowed: frozenset[str] | None) -> None:
    found: dict[str, tuple[metadata.EntryPoint, metadata.Distribution]] = {}
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                found.setdefault(ep.name, (ep, dist))

    if allowed is not None:
        missing = sorted(allowed - found.keys())
        if missing:
            installed = ", ".join(sorted(found)) or "none"
            raise ResolutionError(
                f"{ALLOW_LIST_ENV} names {', '.join(missing)}, but no installed package has an "
                f"`{ENTRY_POINT_GROUP}` entry point by that name (installed: {installed})"
            )

    names = sorted(found) if allowed is None else sorted(allowed)
    for name in names:
        ep, dist = found[name]
        if pm.get_plugin(name) is not None or pm.is_blocked(name):
            continue
        dist_label = f"{_dist_name(dist)} {dist.version}"
        # Import first, on our own, so that a broken plugin is reported by name in one line
        # instead of as a traceback from inside pluggy.
        try:
            module = ep.load()
        except Exception as exc:  # any import-time failure of third-party code
            raise ResolutionError(
                f"plugin {name!r} (entry point `{ep.value}` of {dist_label}) failed to import: "
                f"{type(exc).__name__}: {exc}; fix or uninstall {_dist_name(dist)}, or leave it "
                f"out with {ALLOW_LIST_ENV}"
            ) from exc
        if pm.is_registered(module):  # already passed in as an extra plugin by its own package
            continue
        # pluggy registers it and records its distribution for `list_plugin_distinfo()`.
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise ResolutionError(f"plugin {name!r} ({dist_label}) cannot be registered: {exc}") from exc


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """A misspelled `@hookimpl` would otherwise be silently ignored."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        origin = _origins(pm).get(id(exc.plugin), (UNKNOWN_DISTRIBUTION, ""))
        raise ResolutionError(
            f"plugin {_label(pm, exc.plugin)!r} ({origin[0]}) implements a hook lmstack does not "
            f"define ({exc}); check its spelling, or the plugin needs a newer lmstack"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every registration hook, recording each component (and stack section) with the
    distribution (and its version) that provided it."""
    registry = Registry()
    origins = _origins(pm)
    for kind in KINDS:
        hook_name = hookspecs.REGISTRATION_HOOKS[kind]
        _call_registration(
            pm, hook_name, origins, lambda *who, k=kind, h=hook_name: _register_callback(registry, k, h, *who)
        )
    _call_registration(pm, SECTIONS_HOOK, origins, lambda *who: _section_callback(registry, *who))
    return registry


SECTIONS_HOOK = "lmstack_register_stack_sections"


def _call_registration(
    pm: pluggy.PluginManager,
    hook_name: str,
    origins: dict[int, tuple[str, str]],
    make_register: Callable[[str, str, str], Callable[[Any], None]],
) -> None:
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        dist, version = origins.get(id(impl.plugin)) or _guess_origin(impl.plugin)
        plugin = _label(pm, impl.plugin)
        register = make_register(plugin, dist, version)
        kwargs = {"register": register} if "register" in impl.argnames else {}
        try:
            impl.function(**kwargs)
        except LmstackError:
            raise
        except Exception as exc:
            raise ResolutionError(
                f"plugin {plugin!r} ({dist}) failed in {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc


def _section_callback(registry: Registry, plugin: str, dist: str, version: str) -> Callable[[Any], None]:
    def register(section: StackSection) -> None:
        if not isinstance(section, StackSection):
            raise ResolutionError(
                f"plugin {plugin!r} ({dist}) passed a {type(section).__name__} to register() in "
                f"{SECTIONS_HOOK}; expected an lmstack.registry.StackSection"
            )
        registry.add_section(section, distribution=dist, version=version)

    return register


def register_commands(pm: pluggy.PluginManager, subparsers: Any) -> None:
    """Let plugins add `lmstack` subcommands (lmstack-api: serve; lmstack-bench: bench)."""
    pm.hook.lmstack_register_commands(subparsers=subparsers)


def default_registry() -> Registry:
    """The registry of a plain run: built-ins plus entry points, as the environment says."""
    return build_registry(make_plugin_manager())


def _register_callback(
    registry: Registry, kind: str, hook_name: str, plugin: str, dist: str, version: str
) -> Callable[[Component], None]:
    def register(component: Component) -> None:
        if not isinstance(component, Component):
            raise ResolutionError(
                f"plugin {plugin!r} ({dist}) passed a {type(component).__name__} to register() "
                f"in {hook_name}; expected an lmstack.registry.Component"
            )
        if component.kind != kind:
            raise ResolutionError(
                f"plugin {plugin!r} ({dist}) registered {component.kind} {component.name!r} "
                f"through {hook_name}, which takes {kind} components; register it through "
                f"{hookspecs.REGISTRATION_HOOKS[component.kind]}"
            )
        registry.add(component, distribution=dist, version=version)

    return register


# ---------------------------------------------------------------------------------------------
# Where a plugin comes from
# ---------------------------------------------------------------------------------------------


def _origins(pm: pluggy.PluginManager) -> dict[int, tuple[str, str]]:
    """id(plugin) -> (distribution, version) for entry-point plugins."""
    return {id(plugin): (dist.project_name, dist.version) for plugin, dist in pm.list_plugin_distinfo()}


def _guess_origin(plugin: object) -> tuple[str, str]:
    top = _module_of(plugin).partition(".")[0]
    if top == "lmstack":
        return "lmstack", lmstack_version()
    dists = _packages_distributions().get(top)
    if dists:
        return dists[0], _version_of(dists[0])
    return UNKNOWN_DISTRIBUTION, ""


_PACKAGES_DISTRIBUTIONS: dict[str, list[str]] | None = None


def _packages_distributions() -> dict[str, list[str]]:
    # Scans every installed distribution's file list: do it at most once per process.
    global _PACKAGES_DISTRIBUTIONS
    if _PACKAGES_DISTRIBUTIONS is None:
        _PACKAGES_DISTRIBUTIONS = dict(metadata.packages_distributions())
    return _PACKAGES_DISTRIBUTIONS


def lmstack_version() -> str:
    return _version_of("lmstack")


def _version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


def _dist_name(dist: metadata.Distribution) -> str:
    return dist.metadata["Name"] or UNKNOWN_DISTRIBUTION


def _module_of(plugin: Any) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    if isinstance(plugin, type):
        return plugin.__module__
    return type(plugin).__module__


def _label(pm: pluggy.PluginManager, plugin: object) -> str:
    """A readable name: the entry-point or module name, else the module and class."""
    name = pm.get_name(plugin)
    if name and not name.isdigit():  # pluggy names unnamed plugins by id()
        return name
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    cls = plugin if isinstance(plugin, type) else type(plugin)
    return f"{cls.__module__}.{cls.__qualname__}"
