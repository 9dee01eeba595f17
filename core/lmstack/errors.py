"""Errors lmstack raises for bad input. Each carries a one-line message naming the problem."""

from __future__ import annotations


class LmstackError(Exception):
    """Base class: a problem the user can fix, reported in one line."""


class ConfigError(LmstackError):
    """A stack file (or mapping) is malformed: unknown key, wrong type, bad value.

    `path` is the key path, e.g. ``scheduler.max_num_seqs``.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class ResolutionError(LmstackError):
    """The stack names an unknown component, or two components cannot work together."""


class InvalidRequestError(LmstackError, ValueError):
    """A request (prompt or sampling parameters) is invalid. `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)
