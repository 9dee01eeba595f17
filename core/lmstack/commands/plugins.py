"""`lmstack plugins`: what is installed, and how to configure it.

Without a name: one table of every component (kind, name, distribution, version, options with
their defaults), one of the stack sections plugins declare and one of what plugins registered
through hooks other plugins own (lmstack-api's tool parsers), within `WIDTH` columns. With a
name: that component (or section) in full — capabilities, API range, where a stack file selects
it, and each option's type, default, allowed values and description. ``--json`` carries the same
details for tools (the README's test checks the option names it mentions against it).
"""

from __future__ import annotations

import difflib
import json
import textwrap
from typing import Any

import msgspec

from lmstack.errors import LmstackError
from lmstack.registry import Component, Extension, OptionDoc, Registry, StackSection
from lmstack.roles import ROLES

WIDTH = 100  # columns the output fits (a terminal, a README code block)
SECTION_KIND = "section"  # the `kind` of a stack section's row in --json

FULL_HINT = (
    "`lmstack plugins NAME` shows one component in full: capabilities, API range, and each "
    "option's type, default, allowed values and description"
)


Item = Component | StackSection | Extension


def extensions(registry: Registry) -> list[Extension]:
    return [e for items in registry.extensions.values() for e in items]


def run(registry: Registry, name: str | None, as_json: bool) -> int:
    items: list[Item] = [*registry.all(), *registry.sections.values(), *extensions(registry)]
    if name is not None:
        items = [i for i in items if i.name == name]
        if not items:
            raise LmstackError(unknown_name(registry, name))
    if as_json:
        print(json.dumps([describe(i) for i in items], indent=2))
    elif name is not None:
        print("\n\n".join(full_view(i) for i in items))
    elif not items:
        print("no components installed")
    else:
        print(overview(registry))
    return 0


def describe(item: Item) -> dict[str, Any]:
    """One --json row. A stack section (kind ``section``) and an extension (its owner's kind,
    e.g. ``tool parser``) have the same keys as a component, so a tool reads them the same way."""
    if isinstance(item, Extension):
        return {
            "kind": item.kind,
            "name": item.name,
            "distribution": item.distribution,
            "version": item.version,
            "api": "",
            "options": [],
            "capabilities": {},
            "requires": {},
            "description": item.description,
        }
    if isinstance(item, StackSection):
        return {
            "kind": SECTION_KIND,
            "name": item.name,
            "distribution": item.distribution,
            "version": item.version,
            "api": "",
            "options": [o.to_json() for o in item.option_docs()],
            "capabilities": {},
            "requires": {},
            "description": item.description,
        }
    return {
        "kind": item.kind,
        "name": item.name,
        "distribution": item.distribution,
        "version": item.version,
        "api": item.api,
        "options": [o.to_json() for o in item.option_docs()],
        "capabilities": _builtins(dict(item.capabilities)),
        "requires": _builtins(dict(item.requires)),
        "description": item.description,
    }


def unknown_name(registry: Registry, name: str) -> str:
    for problem in registry.problems:
        if any(offered == name for _, offered in problem.offered):
            return f"{name!r} is not available: {problem}"
    known = {c.name for c in registry.all()} | set(registry.sections) | {e.name for e in extensions(registry)}
    close = difflib.get_close_matches(name, sorted(known), n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"no installed component or stack section is named {name!r}{hint} (`lmstack plugins` lists them)"


# ---------------------------------------------------------------------------------------------
# The overview
# ---------------------------------------------------------------------------------------------


def overview(registry: Registry) -> str:
    rows = [
        [c.kind, c.name, c.distribution or "-", c.version or "-", _option_summary(c.option_docs())]
        for c in registry.all()
    ]
    out = [table(["KIND", "NAME", "DISTRIBUTION", "VERSION", "OPTIONS (DEFAULT)"], rows)]
    if registry.sections:
        sections = [
            [s.name, s.distribution or "-", s.version or "-", s.description or "-"]
            for s in registry.sections.values()
        ]
        out += ["", table(["STACK SECTION", "DISTRIBUTION", "VERSION", "DESCRIPTION"], sections)]
    if extensions(registry):
        rows = [
            [e.kind, e.name, e.distribution or "-", e.version or "-", e.description or "-"]
            for e in extensions(registry)
        ]
        out += ["", table(["KIND", "NAME", "DISTRIBUTION", "VERSION", "DESCRIPTION"], rows)]
    out += ["", *textwrap.wrap(FULL_HINT, WIDTH)]
    return "\n".join(out)


def _option_summary(options: list[OptionDoc]) -> str:
    if not options:
        return "-"
    return ", ".join(
        f"{o.name} (required)" if o.required else f"{o.name}={_value(o.default)}" for o in options
    )


def table(header: list[str], rows: list[list[str]], width: int = WIDTH) -> str:
    """Left-aligned columns within `width`: while the table is too wide, the widest column
    narrows by one, and cells wrap inside their column (a long option list takes several lines
    rather than pushing the line past the terminal)."""
    gap, floor = 2, 6
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    while sum(widths) + gap * (len(widths) - 1) > width and max(widths) > floor:
        widths[widths.index(max(widths))] -= 1
    lines = []
    for row in [header, *rows]:
        cells = [textwrap.wrap(str(cell), w, break_on_hyphens=False) or [""] for cell, w in zip(row, widths)]
        for i in range(max(len(c) for c in cells)):
            parts = [(c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
            lines.append((" " * gap).join(parts).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# One component in full
# ---------------------------------------------------------------------------------------------


def full_view(item: Item) -> str:
    origin = " ".join(p for p in (item.distribution, item.version) if p) or "unknown distribution"
    if isinstance(item, Extension):
        lines = _wrapped(f"{item.kind} {item.name!r} ({origin})", "", subsequent="  ")
        lines += _wrapped(item.description, "  ")
        return "\n".join([*lines, f"  registered through {item.hook}"])
    if isinstance(item, StackSection):
        lines = _wrapped(f"stack section {item.name!r} ({origin})", "", subsequent="  ")
        lines += _wrapped(item.description, "  ")
        facts = [("stack file", f"{item.name}: {{{', '.join(_example(item.option_docs()))}}}")]
    else:
        lines = _wrapped(f"{item.kind} {item.name!r} ({origin})", "", subsequent="  ")
        lines += _wrapped(item.description, "  ")
        facts = [
            ("plugin API", item.api or "not declared (any)"),
            ("capabilities", _pairs(item.capabilities) or "-"),
            ("requires", _pairs(item.requires) or "-"),
            ("stack file", "; ".join(_selection(item))),
        ]
    label = max(len(k) for k, _ in facts) + 2
    for key, value in facts:
        wrapped = textwrap.wrap(value, WIDTH - 2 - label, break_on_hyphens=False) or ["-"]
        lines.append(f"  {key.ljust(label)}{wrapped[0]}")
        lines += [f"  {' ' * label}{more}" for more in wrapped[1:]]
    options = item.option_docs()
    lines.append("")
    lines.append("options:" if options else "options: none")
    for option in options:
        lines += option_lines(option)
    return "\n".join(lines)


def option_lines(option: OptionDoc) -> list[str]:
    """``  name: type = default (allowed values)``, then what it does, indented."""
    head = f"{option.name}: {option.type}"
    head += " (required)" if option.required else f" = {_value(option.default)}"
    allowed = allowed_values(option)
    if allowed:
        head += f" ({allowed})"
    lines = _wrapped(head, "  ", subsequent="      ")
    lines += _wrapped(option.description or "(no description)", "      ")
    return lines


def allowed_values(option: OptionDoc) -> str:
    """The choices (when the type does not already spell them) and bounds, in words."""
    parts = []
    if option.choices and "'" not in option.type:
        parts.append("one of: " + ", ".join(_value(v) for v in option.choices))
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "multiple_of": "a multiple of"}
    for key, value in option.bounds.items():
        if key in words:
            parts.append(f"{words[key]} {value}")
        elif key == "min_length":
            parts.append(f"at least {value} long")
        elif key == "max_length":
            parts.append(f"at most {value} long")
        elif key == "pattern":
            parts.append(f"matching {value}")
    return ", ".join(parts)


def _selection(component: Component) -> list[str]:
    """How a stack file selects the component, with its first option as an example:
    ``scheduler: {name: continuous, max_num_seqs: 64}``; the attention roles nest theirs,
    ``attention: {prefill: {name: k, tile: 64}, ...}``."""
    example = _example(component.option_docs())
    sections: dict[str, list[str]] = {}
    for role in ROLES:
        if role.kind == component.kind:
            section, _, key = role.key.partition(".")
            sections.setdefault(section, []).append(key)
    lines = []
    for section, keys in sections.items():
        if len(keys) == 1:
            entries = [f"{keys[0]}: {component.name}", *example]
        else:
            value = f"{{name: {component.name}, {example[0]}}}" if example else component.name
            entries = [f"{key}: {value}" for key in keys]
        lines.append(f"{section}: {{{', '.join(entries)}}}")
    return lines


def _example(options: list[OptionDoc]) -> list[str]:
    first = next((o for o in options if "." not in o.name), None)
    if first is None:
        return []
    return [f"{first.name}: {'...' if first.required else _value(first.default)}"]


# ---------------------------------------------------------------------------------------------
# Values as a stack file writes them
# ---------------------------------------------------------------------------------------------


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _pairs(mapping: Any) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in _builtins(dict(mapping)).items())


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, str_keys=True, enc_hook=repr)


def _wrapped(text: str, indent: str, subsequent: str | None = None) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent if subsequent is None else subsequent,
        break_on_hyphens=False,
    )
