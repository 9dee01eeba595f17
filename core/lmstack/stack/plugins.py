"""Finding plugins and filling the component registry from them.

Built-in components are registered through the same hooks as third-party ones, from the modules
in `DEFAULT_PLUGINS`. Third-party plugins are entry points in group ``lmstack``. Two environment
switches keep runs reproducible (tests must not depend on what happens to be installed):

- ``LMSTACK_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry-point plugins at all;
- ``LMSTACK_PLUGINS=a,b`` loads only the entry points named ``a`` and ``b``.

One broken plugin must not take every command down. An autoloaded entry-point plugin that
fails to import, implements a hook wrongly (a misspelled name, a misnamed argument), raises in
its registration hook or registers something invalid is *skipped*: one warning line (logger
``lmstack.stack.plugins``) names it and its distribution, and the problem is kept in
`Registry.problems` (`lmstack plugins --check` lists them; an unknown component name mentions
them). Plugins the user asked for by name — built-ins, `extra_plugins`, entry points in the
``LMSTACK_PLUGINS`` allow-list — fail loudly instead, with the same message.

A plugin may own hooks of its own (lmstack-api: its tool parsers): `lmstack.stack.owned_hooks`.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata as metadata
import inspect
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pluggy

from lmstack import hookspecs
from lmstack.errors import LmstackError, ResolutionError, one_line
from lmstack.registry import KINDS, Component, InvalidComponent, PluginProblem, Registry, StackSection
from lmstack.stack.origins import UNKNOWN_DISTRIBUTION, UNKNOWN_VERSION, lmstack_version, origin_of
from lmstack.stack.origins import dist_name as _dist_name
from lmstack.stack.origins import guess_origin as _guess_origin
from lmstack.stack.origins import label as _label
from lmstack.stack.origins import origins as _origins
from lmstack.stack.owned_hooks import add_plugin_hookspecs, extension_collector

if TYPE_CHECKING:
    from lmstack.registry import Extension

__all__ = [
    "ALLOW_LIST_ENV",
    "AUTOLOAD_ENV",
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PluginManager",
    "PluginProblem",
    "UNKNOWN_DISTRIBUTION",
    "UNKNOWN_VERSION",
    "build_registry",
    "default_registry",
    "lmstack_version",
    "make_plugin_manager",
    "origin_of",
]

ENTRY_POINT_GROUP = "lmstack"
# The reference components, and the `new-plugin` command (registered as any plugin's command is).
DEFAULT_PLUGINS: tuple[str, ...] = ("lmstack.components.builtins", "lmstack.commands.new_plugin")

AUTOLOAD_ENV = "LMSTACK_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_LIST_ENV = "LMSTACK_PLUGINS"


SECTIONS_HOOK = "lmstack_register_stack_sections"
# Hooks whose whole job is to call `register`: a plugin implementing only these that never
# calls it offers nothing.
_REGISTERING_HOOKS = frozenset({*hookspecs.REGISTRATION_HOOKS.values(), SECTIONS_HOOK})

_TRUE = {"1", "true", "yes", "on"}

log = logging.getLogger(__name__)


def autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in _TRUE


def allow_list_from_env() -> frozenset[str] | None:
    """Entry-point names from ``LMSTACK_PLUGINS``; None when unset or empty (load all)."""
    raw = os.environ.get(ALLOW_LIST_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return names or None


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, plus what lmstack learns while loading: the problems found so far and
    which plugins are tolerated when broken (autoloaded entry points) rather than fatal."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.problems: list[PluginProblem] = []
        self.tolerant: set[int] = set()  # id(plugin): skip it with a warning when broken
        self.entry_points: set[int] = set()  # id(plugin): checked for "registers nothing"
        self.spec_modules: set[str] = set()  # hookspec modules plugins added
        self.owned_hooks: dict[str, str] = {}  # plugin-owned registration hook -> what it registers


def make_plugin_manager(
    *,
    autoload: bool | None = None,
    extra_plugins: Iterable[object | str] = (),
    allow: Iterable[str] | None = None,
    default_plugins: Iterable[str] | None = None,
) -> PluginManager:
    """A plugin manager with the built-ins, `extra_plugins`, then entry-point plugins.

    `autoload` / `allow` default to the environment switches. `extra_plugins` are plugin
    objects or importable module names (tests use them for fake plugins). `default_plugins`
    replaces `DEFAULT_PLUGINS` (tests that want only their fakes pass ``()``).
    """
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)

    for module_name in DEFAULT_PLUGINS if default_plugins is None else tuple(default_plugins):
        # A built-in failing to import is a broken install, not a user error: let it raise.
        _register(pm, importlib.import_module(module_name), module_name)
    extras = [(importlib.import_module(p), p) if isinstance(p, str) else (p, None) for p in extra_plugins]
    for plugin, _ in extras:  # hooks an extra plugin owns, before any extra is checked against them
        add_plugin_hookspecs(pm, plugin)
    for plugin, name in extras:
        _register(pm, plugin, name)

    if autoload_enabled() if autoload is None else autoload:
        allowed = allow_list_from_env() if allow is None else frozenset(allow)
        _load_entry_points(pm, allowed)

    _check_hook_names(pm)
    return pm


def _register(pm: pluggy.PluginManager, plugin: object, name: str | None) -> None:
    """Register a plugin the user named (built-in, extra): any problem is an error."""
    label = name or _label(pm, plugin)
    wrong = add_plugin_hookspecs(pm, plugin) or _hookimpl_problems(pm, plugin)
    if wrong:
        dist, version = _guess_origin(plugin)
        raise ResolutionError(str(PluginProblem(label, dist, version, wrong[0])))
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise ResolutionError(f"plugin {label!r} cannot be registered: {one_line(exc)}") from exc


def _load_entry_points(pm: PluginManager, allowed: frozenset[str] | None) -> None:
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

    # Only an autoloaded plugin is skipped when broken: one the allow-list names was asked for.
    tolerant = allowed is None
    names = sorted(found) if allowed is None else sorted(allowed)
    loaded = []
    for name in names:
        ep, dist = found[name]
        if pm.get_plugin(name) is not None or pm.is_blocked(name):
            continue
        dist_name = _dist_name(dist)
        problem = functools.partial(
            _entry_point_problem, pm, name, dist_name, dist.version, fatal=not tolerant
        )
        # Import first, on our own, so that a broken plugin is reported by name in one line
        # instead of as a traceback from inside pluggy.
        try:
            module = ep.load()
        except Exception as exc:  # any import-time failure of third-party code
            log.debug("plugin %r failed to import", name, exc_info=True)
            problem(
                f"failed to import {ep.value}: {type(exc).__name__}: {one_line(exc)}; "
                f"fix or uninstall {dist_name}, or leave it out with {ALLOW_LIST_ENV}"
            )
            continue
        loaded.append((name, module, problem))
    # Every plugin's own hookspecs first: a plugin implementing lmstack-api's hooks may load
    # before lmstack-api does.
    hookspec_problems = {id(m): add_plugin_hookspecs(pm, m) for _, m, _ in loaded}
    for name, module, problem in loaded:
        if pm.is_registered(module):  # already passed in as an extra plugin by its own package
            continue
        wrong = hookspec_problems[id(module)] or _hookimpl_problems(pm, module)
        if wrong:
            for message in wrong:  # all of them are listed (an allow-listed plugin: the first raises)
                problem(message)
            continue
        # pluggy registers it and records its distribution for `list_plugin_distinfo()`.
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            if pm.is_registered(module):  # pluggy may have added some of its hooks already
                pm.unregister(module)
            problem(f"cannot be registered: {one_line(exc)}")
            continue
        pm.entry_points.add(id(module))
        if tolerant:
            pm.tolerant.add(id(module))


def _entry_point_problem(
    pm: pluggy.PluginManager, name: str, dist: str, version: str, message: str, *, fatal: bool
) -> None:
    _problem(pm, PluginProblem(name, dist, version, message), fatal=fatal)


def _hookimpl_problems(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """What pluggy would reject or silently ignore about a plugin's `@hookimpl` functions,
    each as a sentence naming the fix: a hook name lmstack does not define (with the closest
    one), an argument the hook does not pass."""
    specs = {name: caller for name, caller in vars(pm.hook).items() if caller.has_spec()}
    problems = []
    for attr in sorted(dir(plugin)):
        try:
            opts = pm.parse_hookimpl_opts(plugin, attr)
        except Exception:  # an attribute that cannot even be read is no hook
            continue
        if opts is None:
            continue
        hook = opts.get("specname") or attr
        caller = specs.get(hook)
        if caller is None:
            if opts.get("optionalhook"):
                continue
            close = difflib.get_close_matches(hook, list(specs), n=1)
            hint = (
                f"did you mean {close[0]}?"
                if close
                else "check its spelling, or the plugin needs a newer lmstack"
            )
            problems.append(f"implements {hook}, which lmstack does not define; {hint}")
            continue
        spec_args = tuple(caller.spec.argnames)
        extra = [a for a in _required_args(getattr(plugin, attr)) if a not in spec_args]
        if extra:
            names = ", ".join(f"`{a}`" for a in extra)
            if len(spec_args) == 1:
                fix = f"name it `{spec_args[0]}`"
            else:
                fix = "its arguments are " + ", ".join(f"`{a}`" for a in spec_args)
            problems.append(f"declares argument {names} in {hook}, which lmstack does not pass; {fix}")
    return problems


def _required_args(function: Any) -> list[str]:
    """The positional parameters without a default (those pluggy must fill from the hook call),
    without an unbound `self` / `cls`."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    if names and names[0] in ("self", "cls") and not inspect.ismethod(function):
        names = names[1:]
    return names


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """A misspelled `@hookimpl` would otherwise be silently ignored (`_hookimpl_problems`
    catches it before registration; this is the net for plugins registered some other way)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        origin = _origins(pm).get(id(exc.plugin), (UNKNOWN_DISTRIBUTION, ""))
        raise ResolutionError(
            f"plugin {_label(pm, exc.plugin)!r} ({origin[0]}) implements a hook lmstack does not "
            f"define ({one_line(exc)}); check its spelling, or the plugin needs a newer lmstack"
        ) from exc


def _problem(pm: pluggy.PluginManager, problem: PluginProblem, *, fatal: bool) -> None:
    """Raise it (the user asked for this plugin) or record it and warn once."""
    if fatal:
        raise ResolutionError(str(problem))
    problems = getattr(pm, "problems", None)
    if problems is not None:
        problems.append(problem)
    warn(problem)


_WARNED: set[str] = set()


def warn(problem: PluginProblem) -> None:
    """Log a problem as one warning line, once per process (the CLI builds the plugin
    manager more than once per command)."""
    line = str(problem)
    if problem.skipped:
        line += " (skipped; `lmstack plugins --check` lists every problem)"
    if line not in _WARNED and log.isEnabledFor(logging.WARNING):
        _WARNED.add(line)
        log.warning(line)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


@dataclass
class _Offer:
    """What one plugin's registration hooks handed to `register`, before it enters the registry."""

    plugin: str
    distribution: str
    version: str
    items: list[Component | StackSection] = field(default_factory=list)
    extensions: list[Extension] = field(default_factory=list)  # through hooks plugins own
    offered: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    registering_hooks: int = 0  # component / section registration hooks it implements
    obj: object = None  # the plugin itself

    def problem(self, message: str, skipped: bool = True) -> PluginProblem:
        return PluginProblem(
            self.plugin, self.distribution, self.version, message, skipped, tuple(self.offered)
        )


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every registration hook, recording each component (and stack section) with the
    distribution (and its version) that provided it.

    A plugin whose hooks raise or register something invalid is an error, unless it is an
    autoloaded entry point: then it is skipped, with a warning and an entry in
    `registry.problems`, and none of its components are registered."""
    registry = Registry()
    registry.problems.extend(getattr(pm, "problems", ()))
    tolerant: set[int] = getattr(pm, "tolerant", set())
    entry_points: set[int] = getattr(pm, "entry_points", set())
    origins = _origins(pm)
    offers: dict[int, _Offer] = {}  # id(plugin) -> its offer, in the order plugins were registered

    def offer_of(plugin: object) -> _Offer:
        if id(plugin) not in offers:
            dist, version = origins.get(id(plugin)) or _guess_origin(plugin)
            offers[id(plugin)] = _Offer(_label(pm, plugin), dist, version, obj=plugin)
        return offers[id(plugin)]

    def report(problem: PluginProblem) -> None:
        warn(problem)
        registry.problems.append(problem)

    # Hook implementations run in registration order: built-ins first, so a plugin reusing a
    # built-in name is the one reported as the clash.
    for plugin in pm.get_plugins():
        offer_of(plugin)
    for kind in KINDS:
        _call_registration(pm, hookspecs.REGISTRATION_HOOKS[kind], kind, offer_of, tolerant)
    _call_registration(pm, SECTIONS_HOOK, None, offer_of, tolerant)
    owned: dict[str, str] = getattr(pm, "owned_hooks", {})
    for hook_name, what in owned.items():
        _call_registration(pm, hook_name, what, offer_of, tolerant, extension=True)

    for plugin_id, offer in offers.items():
        if offer.problems:
            # Only a tolerated plugin gets here with problems (any other raised already).
            for message in offer.problems:
                report(offer.problem(message))
            continue
        try:
            _add_offer(registry, offer)
        except ResolutionError as exc:
            if plugin_id not in tolerant:
                raise
            report(offer.problem(f"clashes with another plugin: {one_line(exc)}"))
            continue
        other_hooks = [
            c
            for c in pm.get_hookcallers(offer.obj) or ()
            if c.name not in _REGISTERING_HOOKS and c.name not in owned
        ]
        if plugin_id in entry_points and not (offer.items or offer.extensions or other_hooks):
            report(_registers_nothing(offer))
    return registry


def _call_registration(
    pm: pluggy.PluginManager,
    hook_name: str,
    kind: str | None,
    offer_of: Any,
    tolerant: set[int],
    extension: bool = False,
) -> None:
    """Call one registration hook of every plugin, collecting what each registers (and what
    is wrong with it) in its offer. With `extension`, the hook is a plugin's own and `kind`
    is its word for what it registers."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        offer: _Offer = offer_of(impl.plugin)
        offer.registering_hooks += 1
        register = (extension_collector if extension else _collector)(offer, hook_name, kind)
        kwargs = {"register": register} if "register" in impl.argnames else {}
        before = len(offer.problems)
        try:
            impl.function(**kwargs)
        except InvalidComponent as exc:  # raised by Component() inside the hook
            offer.problems.append(f"offers an invalid component in {hook_name}: {exc}")
        except LmstackError as exc:
            offer.problems.append(f"failed in {hook_name}: {one_line(exc)}")
        except Exception as exc:
            log.debug("plugin %r failed in %s", offer.plugin, hook_name, exc_info=True)
            offer.problems.append(f"failed in {hook_name}: {type(exc).__name__}: {one_line(exc)}")
        if len(offer.problems) > before and id(impl.plugin) not in tolerant:
            raise ResolutionError(str(offer.problem(offer.problems[before])))


def _collector(offer: _Offer, hook_name: str, kind: str | None) -> Any:
    """The `register` callback one plugin's hook receives. A wrong argument is recorded as a
    problem of the plugin (never raised into the plugin's own code, which might swallow it)."""

    def register(item: Any) -> None:
        expected = Component if kind is not None else StackSection
        if not isinstance(item, expected):
            offer.problems.append(
                f"passed a {type(item).__name__} to register() in {hook_name}; expected an "
                f"{expected.__module__}.{expected.__name__}"
            )
            return
        if isinstance(item, StackSection):
            offer.items.append(item)
            return
        offer.offered.append((item.kind, item.name))
        if item.kind != kind:
            offer.problems.append(
                f"registered {item.kind} {item.name!r} through {hook_name}, which takes {kind} "
                f"components; register it through {hookspecs.REGISTRATION_HOOKS[item.kind]}"
            )
            return
        if offer.distribution and not item.distribution:
            item = replace(item, distribution=offer.distribution, version=offer.version)
        mismatch = item.api_mismatch()
        if mismatch is not None:
            offer.problems.append(f"is refused: {mismatch}")
            return
        offer.items.append(item)

    return register


def _add_offer(registry: Registry, offer: _Offer) -> None:
    """Put one plugin's components and sections into the registry: all of them, or (on a name
    clash, raised) none."""
    added: list[Component | StackSection] = []
    extensions: list[Extension] = []
    try:
        for extension in offer.extensions:
            registry.add_extension(extension)
            extensions.append(extension)
        for item in offer.items:
            if isinstance(item, StackSection):
                registry.add_section(item, distribution=offer.distribution, version=offer.version)
            else:
                registry.add(item, distribution=offer.distribution, version=offer.version)
            added.append(item)
    except ResolutionError:
        for item in added:
            if isinstance(item, StackSection):
                registry.sections.pop(item.name, None)
            else:
                registry.discard(item.kind, item.name)
        for extension in extensions:
            registry.extensions[extension.hook].remove(extension)
        raise


def _registers_nothing(offer: _Offer) -> PluginProblem:
    if offer.registering_hooks:
        message = (
            "registers nothing: its registration hooks never call register(); call "
            "register(Component(...)) once per component"
        )
    else:
        message = (
            "registers nothing: its module has no @hookimpl functions; mark each hook with "
            "@hookimpl (from lmstack.hookspecs import hookimpl), e.g. "
            "`@hookimpl def lmstack_register_schedulers(register): ...`"
        )
    return PluginProblem(offer.plugin, offer.distribution, offer.version, message, skipped=False)


def register_commands(pm: pluggy.PluginManager, subparsers: Any) -> None:
    """Let plugins add `lmstack` subcommands (lmstack-api: serve; lmstack-bench: bench)."""
    pm.hook.lmstack_register_commands(subparsers=subparsers)


def default_registry() -> Registry:
    """The registry of a plain run: built-ins plus entry points, as the environment says."""
    return build_registry(make_plugin_manager())
