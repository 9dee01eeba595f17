"""`/ready` (readiness) beside `/health` (liveness), in one process on the tiny model: ready once
loaded; 503 naming why while loading, after a failed load, while a step runs past the step
bound (`LMSTACK_STEP_TIMEOUT_S`), while draining, and once the engine loop has ended."""

from __future__ import annotations

import threading
import time

import pytest
from litestar.testing import TestClient

from lmstack.engine.async_engine import AsyncEngine
from lmstack.engine.llm import LLM
from lmstack.testing.kit import tiny_stack
from lmstack_api.app import create_app
from lmstack_api.state import ServerState


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_stack(tiny_model_path))


def _ready(client) -> tuple[int, dict]:
    r = client.get("/ready")
    return r.status_code, r.json()


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_ready_when_loaded_then_503_while_draining(llm):
    engine = AsyncEngine(llm.engine)
    state = ServerState(llm.engine.stack, engine)
    with TestClient(create_app(llm.engine.stack, state)) as client:
        assert _ready(client) == (200, {"status": "ready"})
        state.start_draining()
        status, body = _ready(client)
        assert status == 503 and body["status"] == "draining", body
        assert client.get("/ready").headers["retry-after"] == "5"
    engine.shutdown()


def test_503_while_loading_and_after_a_failed_load(llm, monkeypatch):
    state = ServerState(llm.engine.stack)

    async def never_loads() -> None:  # the server's load, held back: the state stays "loading"
        return None

    monkeypatch.setattr(state, "load", never_loads)
    with TestClient(create_app(llm.engine.stack, state)) as client:
        assert _ready(client) == (503, {"status": "loading", "reason": "the model is still loading"})
        assert client.get("/health").status_code == 503
        state.load_error = "ImportError: no module named secret_plugin"
        status, body = _ready(client)
        assert status == 503 and body["status"] == "failed"
        assert "secret_plugin" not in str(body)  # the reason stays in the log


def test_a_step_past_the_bound_is_stalled_until_it_ends(llm, monkeypatch):
    monkeypatch.setenv("LMSTACK_STEP_TIMEOUT_S", "1")
    inner = llm.engine
    release = threading.Event()
    real_step = inner.step

    def slow_step():
        release.wait(30)  # a step that does not come back until the test lets it
        return real_step()

    monkeypatch.setattr(inner, "step", slow_step)
    engine = AsyncEngine(inner)
    state = ServerState(inner.stack, engine)
    with TestClient(create_app(inner.stack, state)) as client:
        assert _ready(client)[0] == 200
        client_thread = threading.Thread(
            target=client.post,
            args=("/v1/completions",),
            kwargs={"json": {"prompt": "hello", "max_tokens": 2}},
        )
        client_thread.start()
        assert _until(lambda: _ready(client)[1].get("status") == "stalled"), _ready(client)
        _, body = _ready(client)
        assert "LMSTACK_STEP_TIMEOUT_S" in body["reason"]
        assert client.get("/health").status_code == 200  # liveness: a slow step is no reason to restart
        release.set()
        client_thread.join(60)
        assert _until(lambda: _ready(client)[0] == 200)
    engine.shutdown()


def test_503_once_the_engine_loop_has_ended(llm):
    engine = AsyncEngine(llm.engine)
    state = ServerState(llm.engine.stack, engine)
    with TestClient(create_app(llm.engine.stack, state)) as client:
        assert _ready(client)[0] == 200
        engine.shutdown()  # the loop ends; the engine (shared_llm's) stays
        status, body = _ready(client)
        assert status == 503 and body == {"status": "failed", "reason": "the engine loop has ended"}
