"""Where a plugin comes from: its distribution and version, and a readable name for messages."""

from __future__ import annotations

import importlib.metadata as metadata
import types
from typing import Any

import pluggy

UNKNOWN_DISTRIBUTION = "<unknown>"
UNKNOWN_VERSION = "0+unknown"


def origin_of(pm: pluggy.PluginManager, plugin: object) -> tuple[str, str]:
    """(distribution, version) of a registered plugin, as far as it can be told."""
    return origins(pm).get(id(plugin)) or guess_origin(plugin)


def origins(pm: pluggy.PluginManager) -> dict[int, tuple[str, str]]:
    """id(plugin) -> (distribution, version) for entry-point plugins."""
    return {id(plugin): (dist.project_name, dist.version) for plugin, dist in pm.list_plugin_distinfo()}


def guess_origin(plugin: object) -> tuple[str, str]:
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


def dist_name(dist: metadata.Distribution) -> str:
    return dist.metadata["Name"] or UNKNOWN_DISTRIBUTION


def _module_of(plugin: Any) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    if isinstance(plugin, type):
        return plugin.__module__
    return type(plugin).__module__


def label(pm: pluggy.PluginManager, plugin: object) -> str:
    """A readable name: the entry-point or module name, else the module and class."""
    name = pm.get_name(plugin)
    if name and not name.isdigit():  # pluggy names unnamed plugins by id()
        return name
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    cls = plugin if isinstance(plugin, type) else type(plugin)
    return f"{cls.__module__}.{cls.__qualname__}"
