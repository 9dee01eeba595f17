"""`--set key.path=value` over a stack: the command line's overrides (and `LLM(model=..., dtype=...)`'s
keywords), set in the stack's mapping before it is parsed, so a wrong key is the same error as in
a stack file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from lmstack.errors import ConfigError
from lmstack.stack.config import ATTENTION_PHASES, _kind, _yaml_message


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["scheduler.max_num_seqs=8", "attention=torch"]` as {dotted path: value}; each value is
    read as YAML (8 is a number, `{name: x}` a mapping, `null` null). A later key wins."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. scheduler.max_num_seqs=8")
        try:
            out[key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not YAML ({_yaml_message(exc, key)})") from None
    return out


def apply_overrides(data: Any, overrides: Mapping[str, Any]) -> Any:
    """`data` (a stack mapping) with each dotted path of `overrides` set to its value. A section
    given in short form is widened first: `scheduler: fcfs` is `{name: fcfs}`, `quant: gguf`
    is `{weights: gguf}`, `attention: torch` is the kernel of both phases. An unknown key is
    left for the stack's own checks, so it is the same error as in a file."""
    if not overrides:
        return data
    if not isinstance(data, Mapping):
        return data  # parse_stack's "must be a mapping" error
    out = _copy(data)
    for key, value in overrides.items():
        parts = key.split(".")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                child = _widen(child, parts[: depth + 1])
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _widen(value: Any, path: list[str]) -> dict[str, Any]:
    where = ".".join(path)
    if value is None:
        return {}
    if not isinstance(value, str):
        raise ConfigError(f"cannot set a key inside {where}: it is {_kind(value)}, not a mapping", where)
    if len(path) == 1 and path[0] == "quant":
        return {"weights": value}
    if len(path) == 1 and path[0] == "attention":
        return {phase: value for phase in ATTENTION_PHASES}
    return {"name": value}
