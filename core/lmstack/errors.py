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


class BuildError(LmstackError):
    """A component's factory (or the model load it drives) raised while the stack was built.

    The message names the role, the component and its distribution, then the cause:
    ``prefill kernel 'flash' (lmstack-flash 1.2) failed to build: OSError: no such file``. The
    original exception is the `__cause__` (its traceback goes to the log, not to the user)."""

    def __init__(
        self,
        role: str,
        component: str,
        distribution: str,
        version: str,
        cause: BaseException,
        *,
        what: str = "failed to build",
    ) -> None:
        self.role, self.component, self.distribution, self.version = role, component, distribution, version
        self.cause = cause
        origin = " ".join(p for p in (distribution, version) if p) or "unknown distribution"
        text = " ".join(str(cause).split())
        # An LmstackError's text is already written for the user; anything else is a bug or an
        # environment problem, where the exception type says a lot.
        if isinstance(cause, LmstackError) and text:
            reason = text
        else:
            reason = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
        self.what = what
        super().__init__(f"{role} {component!r} ({origin}) {what}: {reason}")

    def __reduce__(self):  # picklable across worker processes despite the keyword-rich __init__
        args = (self.role, self.component, self.distribution, self.version, self.cause)
        return (_rebuild_build_error, (args, self.what))


def _rebuild_build_error(args: tuple, what: str) -> BuildError:
    return BuildError(*args, what=what)


class JoinTimeout(LmstackError):
    """Ranks of a multi-process layout did not join the process group in time (a machine or
    worker that never started, a wrong MASTER_ADDR / port). The message names the ranks."""


class EngineDeadError(RuntimeError):
    """The engine cannot run another step: its executor's ranks are gone or out of step. Every
    request in flight fails with it, new ones are refused, and a server exits non-zero."""


class WorkerDied(EngineDeadError):
    """A worker process of a multi-process executor died (or stopped answering)."""


def one_line(exc: BaseException) -> str:
    """An exception as one line for a CLI message or a log record (its text, whitespace folded)."""
    return " ".join((str(exc) or type(exc).__name__).split())
