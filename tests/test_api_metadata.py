"""Request metadata over HTTP: the caller's `X-Request-Id` adopted and echoed, the tenant from
`X-Tenant` on a server without API keys, and both reaching the engine's `Request`. (Tenants
from API keys: test_api_hardening.py, whose server has keys.)"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from test_api_server import STACK
from test_engine import STACK as ENGINE_STACK
from test_engine import RecordingScheduler

MODEL = STACK["model"]
ROUTES = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-"}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(STACK)  # test_api_server.py's server: no extra process


def body(path: str, max_tokens: int = 1, **extra) -> dict:
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    return {"model": MODEL, **prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def post(server, path: str, headers: dict[str, str], stream: bool = False, **extra) -> tuple[int, str, str]:
    """(status, X-Request-Id header, the body's id) of one call, streamed or not."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        if not stream:
            r = http.post(path, json=body(path, **extra), headers=headers)
            return r.status_code, r.headers.get("x-request-id"), r.json().get("id")
        with http.stream("POST", path, json=body(path, stream=True, **extra), headers=headers) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            for _ in lines:  # to the end: the log line is written before [DONE]
                pass
            return r.status_code, r.headers.get("x-request-id"), json.loads(first[6:])["id"]


def finished(server, client_id: str) -> list[dict]:
    return [r for r in server.log_records("request finished") if r.get("client_request_id") == client_id]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(ROUTES))
def test_a_well_formed_request_id_is_adopted_and_echoed(server, path, stream):
    client_id = f"trace:{uuid.uuid4()}.{stream}_x"
    status, echoed, body_id = post(server, path, {"X-Request-Id": client_id}, stream)
    assert status == 200 and echoed == client_id
    # The body's id stays the server's own, OpenAI-shaped.
    assert body_id.startswith(ROUTES[path]) and client_id not in body_id
    (line,) = finished(server, client_id)
    assert line["request_id"] == body_id and line["tenant"] is None


def test_a_malformed_or_missing_request_id_is_replaced_by_the_servers(server):
    # The replacement happens before the routes differ (Job.echo_id): one route is enough.
    for bad in (b"has spaces", b"x" * 129, None):
        headers = {} if bad is None else {"X-Request-Id": bad}
        status, echoed, body_id = post(server, "/v1/completions", headers, stream=bad is None)
        assert status == 200 and echoed == body_id and echoed.startswith("cmpl-"), bad


def test_one_request_id_twice_in_flight_does_not_collide(server):
    """A second request with the same id runs to the end while the first is still generating
    (500 tokens, cut off once the second is done): two engine requests, both echo the id."""
    client_id = f"dup-{uuid.uuid4()}"
    headers = {"X-Request-Id": client_id}
    first = body("/v1/completions", stream=True, max_tokens=500, ignore_eos=True)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=first, headers=headers) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == client_id
            lines = r.iter_lines()  # kept: a collected line iterator closes the connection
            assert next(line for line in lines if line.startswith("data: {"))  # generating
            status, echoed, _ = post(server, "/v1/completions", headers, max_tokens=4, ignore_eos=True)
            assert status == 200 and echoed == client_id
    deadline = time.monotonic() + 30  # the first is aborted once the server sees it closed
    while len(logged := finished(server, client_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    # "disconnected": the first was still running when the second had finished.
    assert [(line["status"], line["completion_tokens"] < 500) for line in logged] == [
        ("ok", True),
        ("disconnected", True),
    ]
    assert logged[0]["completion_tokens"] == 4 and logged[0]["request_id"] != logged[1]["request_id"]


def test_x_tenant_is_the_tenant_without_api_keys(server):
    client_id = f"tenant-{uuid.uuid4()}"
    status, _, _ = post(server, "/v1/completions", {"X-Request-Id": client_id, "X-Tenant": "acme.eu-1_b"})
    assert status == 200
    (line,) = finished(server, client_id)
    assert line["tenant"] == "acme.eu-1_b"


@pytest.mark.parametrize("bad", ["two words", "t" * 65, "", "a/b"])
def test_a_malformed_x_tenant_is_400_naming_the_header(server, bad):
    for path in ROUTES:
        status, err, headers = server.post(path, body(path), {"X-Tenant": bad, "X-Request-Id": "t-400"})
        assert status == 400, err
        assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == "t-400"  # errors echo it too
        assert err["error"]["param"] == "X-Tenant" and "X-Tenant" in err["error"]["message"]
        assert err["error"]["type"] == "invalid_request_error"
    assert server.get("/v1/models", {"X-Tenant": bad})[0] == 200  # only generation reads it


def test_http_metadata_reaches_the_engines_scheduler(shared_llm, monkeypatch):
    """The whole way in one process: HTTP headers and whether the call streams -> the app ->
    AsyncEngine -> the scheduler."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    engine = shared_llm(ENGINE_STACK).engine  # test_engine.py's: no extra model load
    recorder = RecordingScheduler(engine.scheduler)
    monkeypatch.setattr(engine, "scheduler", recorder)
    async_engine = AsyncEngine(engine)  # the engine stays shared_llm's: shutdown leaves it alone
    app = create_app(engine.stack, ServerState(engine.stack, async_engine))
    headers = {"X-Request-Id": "trace-7", "X-Tenant": "acme"}
    with TestClient(app) as client:
        for path in ROUTES:
            r = client.post(path, json=body(path, max_tokens=1), headers=headers)
            assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7", r.text
        r = client.post("/v1/completions", json=body("/v1/completions", max_tokens=1))
        assert r.status_code == 200
        for path in ROUTES:
            r = client.post(path, json=body(path, max_tokens=1, stream=True))
            assert r.status_code == 200 and "data: [DONE]" in r.text
    assert [seen[1:] for seen in recorder.seen[:3]] == [
        ("trace-7", "acme"),
        ("trace-7", "acme"),
        (None, None),
    ]
    # Only SSE clients read tokens as they come: the scheduler bounds the gaps for those alone.
    assert recorder.streamed == [False, False, False, True, True]
    assert not engine.has_unfinished()
