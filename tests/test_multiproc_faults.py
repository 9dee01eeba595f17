"""Worker faults and many machines, on real `lmstack serve` processes with the test `replicas`
layout (two ranks, each a full replica of the tiny model):

- a worker killed mid-request: the requests in flight end with 5xx OpenAI errors (a streamed
  one with an error event), /health turns 503, the server exits non-zero within 30 s;
- a rank that never joins: one line naming it, non-zero exit;
- two "machines" on loopback, each a `torchrun --nnodes 2` command: rank 0 serves, rank 1 is
  its worker, the answer equals the single-process one, and SIGTERM stops both.
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
from pathlib import Path

import pytest
import yaml

from lmstack.testing.kit import greedy, reference_llm, tiny_stack

pytestmark = pytest.mark.slow

psutil = pytest.importorskip("psutil")
from lmstack_api.testing import ServerProcess, free_port  # noqa: E402

PROMPT = "the cat sat on the mat"


class ReplicasServer(ServerProcess):
    main_module = "lmstack.testing.replicas"


def replicas_stack(tiny_model_path, **layout) -> dict:
    stack = tiny_stack(tiny_model_path, parallel={"name": "replicas", "world_size": 2, **layout})
    # Worker and server on one thread each: 2 cores shared by the test, the server and 2 ranks.
    return stack


def workers_of(pid: int) -> list:
    """The spawned worker processes of a server (not multiprocessing's resource tracker)."""
    kids = psutil.Process(pid).children(recursive=True)
    return [k for k in kids if any("spawn_main" in part for part in k.cmdline())]


def stream_lines(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    lines = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line:
                lines.append(line)
    return lines


def test_killed_worker_fails_requests_turns_health_503_and_exits_nonzero(tiny_model_path):
    env = {"OMP_NUM_THREADS": "1"}
    with ReplicasServer(replicas_stack(tiny_model_path), env=env) as srv:
        assert len(workers_of(srv.proc.pid)) == 2
        long = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
        streamed: list[str] = []
        plain: list[tuple] = []
        first = threading.Event()

        def run_stream() -> None:
            req = urllib.request.Request(
                srv.base_url + "/v1/completions",
                data=json.dumps({**long, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                for raw in resp:
                    if raw.strip():
                        streamed.append(raw.decode().strip())
                        first.set()

        def run_plain() -> None:
            plain.append(srv.post("/v1/completions", long))

        threads = [threading.Thread(target=run_stream), threading.Thread(target=run_plain)]
        for t in threads:
            t.start()
        assert first.wait(60), srv.log()
        victim = workers_of(srv.proc.pid)[-1]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        health = set()
        while srv.proc.poll() is None and time.monotonic() - killed < 30:
            health.add(srv.get("/health")[0])
            time.sleep(0.05)
        code = srv.proc.wait(max(0.1, 30 - (time.monotonic() - killed)))
        for t in threads:
            t.join(30)
        assert code != 0, srv.log()
        assert 503 in health, (health, srv.log())
        # The streamed request: an error event (OpenAI body) then [DONE], never a normal end.
        events = [json.loads(x[len("data: ") :]) for x in streamed if x != "data: [DONE]"]
        assert "error" in events[-1] and events[-1]["error"]["type"] == "server_error", streamed[-3:]
        assert "worker rank" in events[-1]["error"]["message"]
        status, body, _ = plain[0]
        assert status >= 500 and body["error"]["type"] == "server_error", (status, body)
        assert "engine died" in srv.log()


def test_rank_that_never_joins_is_one_line_naming_it(tiny_model_path, monkeypatch):
    # This process as rank 0 of a launched 2-rank group whose rank 1 never starts.
    from lmstack.engine.llm import LLM
    from lmstack.errors import BuildError
    from lmstack.stack.plugins import make_plugin_manager

    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    pm = make_plugin_manager(autoload=False, extra_plugins=["lmstack.testing.replicas"])
    started = time.monotonic()
    with pytest.raises(BuildError) as info:
        LLM(replicas_stack(tiny_model_path, join_timeout_s=1.5), plugin_manager=pm)
    message = str(info.value)
    assert "rank 1 of 2 did not join within 1.5 s (rendezvous at 127.0.0.1:" in message
    assert "\n" not in message and time.monotonic() - started < 30


def torchrun(node_rank: int, port: int, stack_path: Path, log: Path) -> subprocess.Popen:
    # `python -m torch.distributed.run` is `torchrun` with this interpreter.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank)]
    cmd += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "lmstack.testing.replicas", "serve", str(stack_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def test_two_nodes_over_torchrun_serve_single_process_tokens_and_stop_on_sigterm(tiny_model_path, tmp_path):
    http_port = free_port()
    stack = replicas_stack(tiny_model_path)
    stack["server"] = {"host": "127.0.0.1", "port": http_port}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(stack))
    master = free_port()
    logs = [tmp_path / f"node{r}.log" for r in range(2)]
    nodes = [torchrun(r, master, path, logs[r]) for r in (1, 0)][::-1]

    def log() -> str:
        return "\n".join(f"--- node {r}\n{p.read_text()}" for r, p in enumerate(logs))

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
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        expected = greedy(reference_llm(tiny_stack(tiny_model_path)), [PROMPT], 12)[0]
        assert text == expected.text
        # Stopping the server is SIGTERM to its process, global rank 0 (the child of node 0's
        # torchrun agent): it drains, tells rank 1 to stop, both ranks exit 0 and so both agents.
        # (SIGTERM to an agent also stops its rank, but torchrun itself then exits non-zero.)
        (rank0,) = [k for k in psutil.Process(nodes[0].pid).children() if "serve" in k.cmdline()]
        rank0.send_signal(signal.SIGTERM)
        codes = [n.wait(60) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert codes == [0, 0], log()
    assert "Traceback" not in log()
