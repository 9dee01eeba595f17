"""The step watchdog of multi-process layouts (`lmstack.exec.multiproc`): a rank that is alive but
makes no progress (here SIGSTOP) must not hang the server. On a real `lmstack serve` with `tp: 2`
on the tiny model and `LMSTACK_STEP_TIMEOUT_S=3`: the streamed request in flight ends with an
error event naming the stall, /health turns 503, and the server exits non-zero — what a killed
worker does. The same under torchrun, where rank 0 serves and steps in-process. A normal stop
prints no gloo teardown errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml

from lmstack.testing.kit import tiny_stack

pytestmark = pytest.mark.slow

psutil = pytest.importorskip("psutil")
from lmstack_api.testing import ServerProcess, free_port  # noqa: E402

STEP_TIMEOUT_S = 3.0
# The error must come within the watchdog's bound; this slack covers killing the workers and a
# busy machine, and is far below "forever" (what a stalled rank cost before the watchdog).
SLACK_S = 20.0


def tp_stack(tiny_model_path) -> dict:
    return tiny_stack(tiny_model_path, parallel={"name": "tp", "tp": 2})


def workers_of(pid: int) -> list:
    """The spawned worker processes of a server (not multiprocessing's resource tracker)."""
    kids = psutil.Process(pid).children(recursive=True)
    return [k for k in kids if any("spawn_main" in part for part in k.cmdline())]


def test_stopped_tp_rank_fails_the_request_within_the_bound_and_the_server_exits(tiny_model_path):
    pytest.importorskip("lmstack_tp")
    env = {"OMP_NUM_THREADS": "1", "LMSTACK_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S)}
    victim = None
    with ServerProcess(tp_stack(tiny_model_path), env=env) as srv:
        try:
            workers = workers_of(srv.proc.pid)
            assert len(workers) == 2, srv.log()
            events: list[str] = []
            first = threading.Event()
            ended = threading.Event()
            body = {"prompt": "the cat sat", "max_tokens": 900, "ignore_eos": True, "temperature": 0}

            def run_stream() -> None:
                req = urllib.request.Request(
                    srv.base_url + "/v1/completions",
                    data=json.dumps({**body, "stream": True}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=120) as resp:
                        for raw in resp:
                            if raw.strip():
                                events.append(raw.decode().strip())
                                first.set()
                finally:
                    ended.set()

            thread = threading.Thread(target=run_stream, daemon=True)
            thread.start()
            assert first.wait(60), srv.log()  # past the first step: the step bound applies
            victim = workers[-1]
            victim.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            health = set()
            while srv.proc.poll() is None and time.monotonic() - stopped < STEP_TIMEOUT_S + SLACK_S:
                health.add(srv.get("/health")[0])
                time.sleep(0.05)
            assert ended.wait(STEP_TIMEOUT_S + SLACK_S), "the stream still hangs after the watchdog bound"
            code = srv.proc.wait(max(0.1, STEP_TIMEOUT_S + SLACK_S - (time.monotonic() - stopped)))
            assert code != 0, srv.log()
            assert 503 in health, (health, srv.log())
            last = json.loads(next(e for e in reversed(events) if e != "data: [DONE]")[len("data: ") :])
            assert last.get("error", {}).get("type") == "server_error", events[-3:]
            message = last["error"]["message"]
            assert "no progress" in message and f"{STEP_TIMEOUT_S:g} s" in message, message
            assert f"pid {victim.pid}) is stopped" in message, message
            assert "engine died" in srv.log()
        finally:
            if victim is not None and victim.is_running():
                victim.send_signal(signal.SIGCONT)
                victim.kill()
    # The engine killed its workers: none is left behind.
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def test_normal_stop_of_a_tp_server_prints_no_gloo_errors(tiny_model_path):
    pytest.importorskip("lmstack_tp")
    with ServerProcess(tp_stack(tiny_model_path), env={"OMP_NUM_THREADS": "1"}) as srv:
        status, _, _ = srv.post("/v1/completions", {"prompt": "the cat", "max_tokens": 4, "temperature": 0})
        assert status == 200, srv.log()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log()
        log = srv.log()
    assert "closed by peer" not in log.lower() and "Traceback" not in log, log[-3000:]


def test_stopped_launched_rank_fails_rank_0s_step_within_the_bound(tiny_model_path, tmp_path):
    """Under torchrun (two "machines" on loopback): rank 0 serves in-process, so no pipe wait
    bounds its step; its collectives are bounded instead once the first step is done."""
    http_port, master = free_port(), free_port()
    stack = tiny_stack(tiny_model_path, parallel={"name": "replicas", "world_size": 2})
    stack["server"] = {"host": "127.0.0.1", "port": http_port}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(stack))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMSTACK_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S)}
    logs = [tmp_path / f"node{r}.log" for r in range(2)]

    def node(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)]
        cmd += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master)]
        cmd += ["-m", "lmstack.testing.replicas", "serve", str(path)]
        return subprocess.Popen(cmd, stdout=logs[rank].open("w"), stderr=subprocess.STDOUT, env=env)

    def log() -> str:
        return "\n".join(f"--- node {r}\n{p.read_text()}" for r, p in enumerate(logs))

    nodes = [node(0), node(1)]
    victim = None
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:
            assert all(n.poll() is None for n in nodes), log()
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log()
            time.sleep(0.25)
        (rank0,) = [k for k in psutil.Process(nodes[0].pid).children() if "serve" in k.cmdline()]
        (victim,) = [k for k in psutil.Process(nodes[1].pid).children() if "serve" in k.cmdline()]
        body = {
            "prompt": "the cat sat",
            "max_tokens": 900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        events: list[str] = []
        with urllib.request.urlopen(req, timeout=STEP_TIMEOUT_S + SLACK_S) as resp:
            for raw in resp:
                if not raw.strip():
                    continue
                events.append(raw.decode().strip())
                if len(events) == 3:  # past the first step: the step bound applies
                    victim.send_signal(signal.SIGSTOP)
                    stopped = time.monotonic()
        assert time.monotonic() - stopped < STEP_TIMEOUT_S + SLACK_S
        last = json.loads(next(e for e in reversed(events) if e != "data: [DONE]")[len("data: ") :])
        assert last.get("error", {}).get("type") == "server_error", events[-3:]
        assert rank0.wait(SLACK_S) != 0, log()
        assert "engine died" in log()
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGCONT)
            victim.kill()
        for n in nodes:
            if n.poll() is None:
                n.kill()
            n.wait(30)
