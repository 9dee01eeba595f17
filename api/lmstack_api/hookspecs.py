"""The hooks lmstack-api owns. Its plugin module names this module in `lmstack_hookspecs`, so the
core adds these specs before any plugin is checked against them (`lmstack.stack.plugins`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lmstack.hookspecs import hookspec

if TYPE_CHECKING:
    from lmstack_api.tool_parsers.base import ToolParser

# Hooks that take a `register` callback: the core collects what each plugin registers (with its
# distribution) into `Registry.extensions[hook]`, and `lmstack plugins` lists it by this word.
REGISTRATION_HOOKS = {"lmstack_register_tool_parsers": "tool parser"}


@hookspec
def lmstack_register_tool_parsers(register: Callable[[type[ToolParser]], None]) -> None:
    """Register tool-call parsers: ``register(MyParser)``, a subclass of
    `lmstack_api.tool_parsers.ToolParser` with a unique `name` (what `server.tool_parser`
    selects). Check it with `lmstack.testing.ToolParserConformance`."""
