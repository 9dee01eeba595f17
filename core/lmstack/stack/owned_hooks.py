"""Hooks a plugin owns: lmstack-api owns `lmstack_register_tool_parsers`, which other plugins
implement to add tool-call parsers.

The owning plugin's module names its hookspec modules in ``lmstack_hookspecs`` (`HOOKSPECS_ATTR`);
the plugin manager adds them before it checks any plugin's hooks, whatever order the plugins load
in. A spec module's ``REGISTRATION_HOOKS`` (hook name -> what the hook registers, e.g. ``"tool
parser"``) marks the hooks that take a `register` callback: `build_registry` calls them as it
calls the core's own, records each registered object (it needs a string ``name``) as an
`Extension` with the distribution that offered it in `Registry.extensions[hook]`, and
`lmstack plugins` lists them. What the objects must be beyond a name, the owner checks.
"""

from __future__ import annotations

import importlib
from typing import Any

import pluggy

from lmstack.errors import one_line
from lmstack.registry import Extension

HOOKSPECS_ATTR = "lmstack_hookspecs"


def add_plugin_hookspecs(pm: pluggy.PluginManager, plugin: object) -> list[str] | None:
    """Add the hookspec modules a plugin names in `HOOKSPECS_ATTR` (once each); the problem as a
    one-item list when they cannot be added, else None."""
    added: set[str] = getattr(pm, "spec_modules", set())
    owned: dict[str, str] = getattr(pm, "owned_hooks", {})
    try:
        modules = getattr(plugin, HOOKSPECS_ATTR, ())
    except Exception:  # an attribute that cannot even be read names no hookspecs
        return None
    for module in modules if isinstance(modules, list | tuple) else (modules,):
        try:
            if isinstance(module, str):
                module = importlib.import_module(module)
            if module.__name__ in added:
                continue
            pm.add_hookspecs(module)
        except Exception as exc:
            return [f"declares hookspecs ({HOOKSPECS_ATTR}) that cannot be added: {one_line(exc)}"]
        added.add(module.__name__)
        owned.update(getattr(module, "REGISTRATION_HOOKS", {}))
    return None


def extension_collector(offer: Any, hook_name: str, what: str) -> Any:
    """The `register` callback one plugin's implementation of an owned hook receives; what it
    registers goes to `offer.extensions`, a wrong argument to `offer.problems`."""

    def register(item: Any) -> None:
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            offer.problems.append(
                f"passed {item!r} to register() in {hook_name}, which has no `name`; a {what} "
                "needs a non-empty string `name`"
            )
            return
        offer.offered.append((what, name))
        # The first sentence of its docstring: one table cell in `lmstack plugins`.
        doc = " ".join((getattr(item, "__doc__", None) or "").split("\n\n")[0].split())
        description = doc.split(". ")[0].rstrip(".")
        offer.extensions.append(
            Extension(hook_name, what, name, item, description, offer.distribution, offer.version)
        )

    return register
