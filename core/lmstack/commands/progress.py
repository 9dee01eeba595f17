"""A one-line progress bar on stderr for long CLI commands (`lmstack quantize`, `lmstack eval`).

Redrawn in place on a terminal; elsewhere (a log file, a pipe) one line per tenth of the work,
so a captured log stays short. No dependency: the core does not ship tqdm."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, unit: str = "", stream: TextIO | None = None) -> None:
        self.total, self.label, self.unit = max(int(total), 1), label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        tenth = self.done * 10 // self.total
        if self._tty or tenth != self._last_tenth:
            self._last_tenth = tenth
            self._draw(note)

    def _draw(self, note: str) -> None:
        frac = self.done / self.total
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        unit = f" {self.unit}" if self.unit else ""
        text = (
            f"{self.label} [{bar:<30}] {self.done}/{self.total}{unit} "
            f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left{' ' + note if note else ''}"
        )
        end = "" if self._tty and self.done < self.total else "\n"
        self.stream.write(("\r" if self._tty else "") + text + end)
        self.stream.flush()

    def close(self) -> None:
        if self._tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
