"""A real `lmstack serve` process for tests, load scripts and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run first in the server process (plain stdlib: importing lmstack's packages here would bind
# names before a `main_module` can patch them): have the kernel send SIGTERM (a graceful server
# shutdown) when the parent ends (Linux `PR_SET_PDEATHSIG` = 1; it fires when the *thread* that
# started the child ends, so start servers from a thread that outlives them, as tests and
# benchmarks do); a parent already gone: exit at once.
END_WITH_PARENT = (
    "import sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes, os, signal\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))\n"
    "    if os.getppid() != {parent}: os._exit(1)\n"
)


class ServerProcess:
    """`lmstack serve` on 127.0.0.1 and a free port, started from a stack mapping; `start()`
    returns once /health says ready. Use as a context manager."""

    # The module whose `main()` runs `lmstack`: a subclass may name one that adds a test plugin.
    main_module = "lmstack.cli"

    def __init__(
        self, stack: dict[str, Any], *, log_path: str | Path | None = None, env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.stack = {**stack, "server": {**stack.get("server", {}), "host": "127.0.0.1", "port": self.port}}
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="lmstack-serve-")
        self.stack_path = Path(self._dir.name) / "stack.yaml"
        self.stack_path.write_text(yaml.safe_dump(self.stack))
        # What follows `lmstack serve`; a test may name a model and options instead.
        self.serve_args: list[str] = [str(self.stack_path)]
        self.log_path = Path(log_path) if log_path else Path(self._dir.name) / "server.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[int] = []  # distinct /health statuses while starting, in order

    def start(self, timeout: float = 180.0) -> ServerProcess:
        # The server ends with the process that started it (a killed pytest must not leave a
        # server behind, loading the machine for the runs after it).
        boot = END_WITH_PARENT.format(parent=os.getpid())
        cmd = [sys.executable, "-c", boot + f"from {self.main_module} import main\nsys.exit(main())"]
        cmd += ["serve", *self.serve_args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            status, _ = self.get("/health")
            if status and (not self.health_seen or self.health_seen[-1] != status):
                self.health_seen.append(status)
            if status == 200:
                return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, b""

    def post(
        self, path: str, body: bytes | dict, headers: dict[str, str] | None = None
    ) -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of a POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read()), dict(resp.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), dict(e.headers)

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample `name` in /metrics whose labels, besides `model_name` (which
        every lmstack metric carries), are `labels`."""
        _, text = self.get("/metrics")
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                rest = {k: v for k, v in sample.labels.items() if k != "model_name"}
                if sample.name == name and rest == labels:
                    return sample.value
        raise KeyError(name)

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def log_records(self, event: str) -> list[dict[str, Any]]:
        """The JSON log lines whose `event` is `event` (e.g. "request finished"), oldest first."""
        records = []
        for line in self.log().splitlines():
            if line.startswith("{") and f'"{event}"' in line:
                record = json.loads(line)
                if record.get("event") == event:
                    records.append(record)
        return records

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM, then wait for the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
