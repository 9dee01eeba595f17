"""The server's structlog lines go to the stderr of the moment, not the stream that was stderr at
configuration: an embedding process (a test runner capturing output) may close that one."""

from __future__ import annotations

import io
import sys

import structlog

from lmstack_api.logs import configure_logging, get_logger


def test_log_lines_follow_sys_stderr_after_configuration(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    try:
        configure_logging("info", json=True)
        get_logger("lmstack.api.test").info("one")
        first.close()  # what a capture does once its test ends
        monkeypatch.setattr(sys, "stderr", second)
        get_logger("lmstack.api.test").info("two")  # raised "I/O operation on closed file" before
        assert '"event": "two"' in second.getvalue()
    finally:
        structlog.reset_defaults()
