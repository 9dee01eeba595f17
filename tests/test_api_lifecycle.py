"""API keys, per-key rate limits, admission, and a SIGTERM drain, on a real server process."""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai")
from lmstack_api.testing import ServerProcess  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEYS = ["sk-alpha", "sk-beta", "sk-drain"]
STACK = {
    "model": MODEL,
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "scheduler": {"name": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 1024},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "64MiB"},
    "server": {
        "api_keys": KEYS[:2],
        "rate_limit": {"requests_per_minute": 3, "output_tokens_per_minute": 4000},
        "max_tokens": 500,
        "drain_timeout_s": 60,
    },
}


@pytest.fixture(scope="module")
def server(smollm2_path):
    # The third key comes from the environment, as operators keep keys out of stack files.
    with ServerProcess(STACK, env={"LMSTACK_API_KEYS": KEYS[2]}) as srv:
        yield srv


def client(server, key):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_missing_or_wrong_key_is_401(server):
    status, body, _ = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "sk-wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    assert server.get("/v1/models")[0] == 401
    assert server.get("/v1/models", {"Authorization": "Bearer sk-alpha"})[0] == 200
    assert server.get("/health")[0] == 200  # probes need no key


def test_max_tokens_cap(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server, "sk-alpha").completions.create(model=MODEL, prompt="Hi", max_tokens=501)
    assert e.value.body["param"] == "max_tokens" and "500" in e.value.body["message"]


def test_rate_limit_per_key(server):
    beta = client(server, "sk-beta")
    # 3 requests per minute: the 4th in quick succession is refused (a slow machine may refill
    # one token every 20 s, so allow a couple more tries before calling it a failure).
    served, error = 0, None
    while error is None and served < 6:
        try:
            beta.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
            served += 1
        except openai.RateLimitError as exc:
            error = exc
    assert error is not None, "no request was rate limited"
    assert served >= 3
    assert error.body["code"] == "rate_limit_exceeded"
    retry_after = int(error.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    # Another key has its own buckets.
    client(server, "sk-alpha").completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    # A request that alone exceeds a per-minute budget can never pass: 400, not 429.
    with pytest.raises(openai.BadRequestError) as e:
        client(server, "sk-alpha").completions.create(model=MODEL, prompt="Hi", max_tokens=400, n=11)
    assert e.value.body["param"] == "max_tokens"


def test_sigterm_drains_in_flight_requests_then_exits_0(server):
    drain = client(server, "sk-drain")
    results: dict[int, tuple[str, object]] = {}
    first_chunk = threading.Barrier(4)

    def stream(i: int) -> None:
        chunks = drain.completions.create(
            model=MODEL,
            prompt=f"Story {i}:",
            max_tokens=60,
            extra_body={"ignore_eos": True},
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, waited = "", None, False
        for c in chunks:
            if not waited:
                first_chunk.wait(60)
                waited = True
            if c.choices:
                text += c.choices[0].text
            usage = c.usage or usage
        results[i] = (text, usage)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    first_chunk.wait(60)
    server.proc.send_signal(__import__("signal").SIGTERM)
    time.sleep(0.5)
    status, body, headers = server.post(
        "/v1/completions", {"prompt": "late", "max_tokens": 2}, {"Authorization": "Bearer sk-drain"}
    )
    assert (
        status == 503
        and body["error"]["code"] == "server_overloaded"
        and "retry-after" in {k.lower() for k in headers}
    )
    assert server.get("/health")[0] == 503
    for t in threads:
        t.join(120)
    assert server.proc.wait(60) == 0
    assert sorted(results) == [0, 1, 2]
    assert all(u is not None and u.completion_tokens == 60 for _, u in results.values())


def test_port_in_use_is_one_line_before_anything_loads(smollm2_path, tmp_path):
    import socket
    import subprocess
    import sys

    import yaml

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        stack = tmp_path / "stack.yaml"
        stack.write_text(yaml.safe_dump({"model": MODEL, "server": {"port": port}}))
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from lmstack.cli import main; sys.exit(main())",
                "serve",
                str(stack),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in proc.stderr and "engine ready" not in proc.stderr


def test_a_test_server_ends_with_the_process_that_started_it(smollm2_path):
    """A killed test run must not leave its `lmstack serve` behind (one once survived its
    pytest for 87 minutes, skewing the benchmarks after it)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    starter = (
        "import json, time; from lmstack_api.testing import ServerProcess; "
        f"s = ServerProcess({json.dumps({'model': MODEL, 'max_model_len': 256})}).start(); "
        "print(s.proc.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(server_pid, 0)  # running
        parent.send_signal(signal.SIGKILL)  # no cleanup of its own: only the kernel can tell
        parent.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not _running(server_pid):
                break
            time.sleep(0.25)
        else:
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("the server outlived the process that started it")
    finally:
        if parent.poll() is None:
            parent.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever adopted it, if anything)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
