"""Tool-call parsers: they turn a model's generated text into content and `tool_calls`.

Built-ins (registered through `lmstack_register_tool_parsers`, as a plugin's are):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3);
- ``llama3_json``: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
  several separated by ``;`` (Llama 3.1 / 3.2 / 3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``;
- ``pythonic``: ``[f(a=1, b="x"), g()]`` (Llama 4, some Llama 3.2), literals only.

Which parser a model gets (`choose_parser`): `server.tool_parser: NAME` when set; else the first
parser whose `matches` accepts the chat template's text, else the first that accepts the model's
family. Plugins' parsers are asked before the built-ins (a plugin is more specific: Qwen3-Coder's
format also uses ``<tool_call>``).
"""

from __future__ import annotations

import functools
import logging

import pluggy

from lmstack.errors import ConfigError
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack_api.config import ServerConfig
from lmstack_api.tool_parsers.base import BufferedParser, ParseDelta, ToolCall, ToolParser
from lmstack_api.tool_parsers.hermes import HermesParser
from lmstack_api.tool_parsers.llama3_json import Llama3JsonParser
from lmstack_api.tool_parsers.mistral import MistralParser
from lmstack_api.tool_parsers.pythonic import PythonicParser

__all__ = [
    "BUILTIN_PARSERS",
    "BufferedParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParseDelta",
    "PythonicParser",
    "ToolCall",
    "ToolParser",
    "available_parsers",
    "check_tool_parser",
    "choose_parser",
]

HOOK = "lmstack_register_tool_parsers"
CONFIG_KEY = "server.tool_parser"

# The order `matches` is asked in: the most specific markers first.
BUILTIN_PARSERS: tuple[type[ToolParser], ...] = (
    MistralParser,
    HermesParser,
    PythonicParser,
    Llama3JsonParser,
)

log = logging.getLogger(__name__)


@functools.cache
def _default_plugin_manager() -> pluggy.PluginManager:
    # As `lmstack serve` loads them: this distribution's plugin even when autoload is off.
    return make_plugin_manager(extra_plugins=["lmstack_api.plugin"])


@functools.lru_cache(maxsize=8)
def _parsers(pm: pluggy.PluginManager) -> dict[str, type[ToolParser]]:
    out: dict[str, type[ToolParser]] = {}
    for ext in build_registry(pm).extensions.get(HOOK, ()):
        if not (isinstance(ext.obj, type) and issubclass(ext.obj, ToolParser)):
            # The core checked the name only; what a parser is, this distribution knows.
            log.warning(
                "tool parser %r (%s) is not a subclass of lmstack_api.tool_parsers.ToolParser; skipped",
                ext.name,
                ext.distribution or "unknown distribution",
            )
            continue
        out[ext.name] = ext.obj
    return out


def available_parsers(plugin_manager: pluggy.PluginManager | None = None) -> dict[str, type[ToolParser]]:
    """Every registered tool parser by name, built-ins first. `plugin_manager`: the one the
    server loaded (default: the plugins `lmstack serve` would load)."""
    return dict(_parsers(plugin_manager or _default_plugin_manager()))


def choose_parser(
    name: str | None,
    chat_template: str | None,
    family: str | None,
    plugin_manager: pluggy.PluginManager | None = None,
) -> type[ToolParser] | None:
    """The parser `name` selects (an unknown name is a `ConfigError` at `server.tool_parser`
    listing the available ones), else the one the chat template or the family matches, else None."""
    parsers = available_parsers(plugin_manager)
    if name is not None:
        if name not in parsers:
            known = ", ".join(sorted(parsers)) or "none"
            raise ConfigError(f"unknown tool parser {name!r}; available: {known}", path=CONFIG_KEY)
        return parsers[name]
    builtins = [p for p in parsers.values() if p in BUILTIN_PARSERS]
    builtins.sort(key=BUILTIN_PARSERS.index)
    ordered = [p for p in parsers.values() if p not in BUILTIN_PARSERS] + builtins
    if chat_template:
        for parser in ordered:
            if parser.matches(chat_template, None):
                return parser
    if family:
        for parser in ordered:
            if parser.matches(None, family):
                return parser
    return None


def check_tool_parser(config: ServerConfig, plugin_manager: pluggy.PluginManager | None = None) -> None:
    """`server.tool_parser` names a registered parser (else the `ConfigError` of `choose_parser`)."""
    if config.tool_parser is not None:
        choose_parser(config.tool_parser, None, None, plugin_manager)
