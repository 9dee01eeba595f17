"""The OpenAI Batch API (`/v1/files`, `/v1/batches`), end to end: a real `lmstack serve` on the
tiny model driven by the official `openai` client. Oracles: the same requests sent one by one
(greedy, fp32), and every custom_id accounted for exactly once, also across a SIGKILL."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("lmstack_api")

from lmstack_api.testing import ServerProcess  # noqa: E402

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
UPLOAD_LIMIT = 200_000


def _stack(model_path, batch_dir, **server) -> dict:
    from lmstack.testing.kit import tiny_stack

    return tiny_stack(
        model_path,
        max_model_len=256,
        allocator={"name": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256},
        cache="none",  # a repeated request runs again in full: its output is the first one's
        server={
            "api_keys": [{"key": KEY_A, "tenant": "a"}, {"key": KEY_B, "tenant": "b"}],
            "batch_dir": str(batch_dir),
            "batch_max_upload_bytes": UPLOAD_LIMIT,
            **server,
        },
    )


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    with ServerProcess(_stack(tiny_model_path, tmp_path_factory.mktemp("batches"))) as srv:
        yield srv


def _client(server, key: str):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def _chat(i: int) -> dict:
    return {
        "model": None,
        "messages": [{"role": "user", "content": f"question number {i}: what comes next?"}],
        "max_tokens": 6 + i % 3,
        "temperature": 0,
    }


def _line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _wait(
    client, batch_id: str, timeout: float = 60.0, until=("completed", "failed", "expired", "cancelled")
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch still {batch.status} after {timeout} s: {batch}")


def _records(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _run_batch(client, lines: list[str], endpoint: str = "/v1/chat/completions"):
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating" and batch.input_file_id == f.id
    return _wait(client, batch.id)


def test_outputs_equal_the_requests_sent_one_by_one(server):
    client = _client(server, KEY_A)
    model = client.models.list().data[0].id
    bodies = {f"req-{i}": {**_chat(i), "model": model} for i in range(8)}
    batch = _run_batch(client, [_line(cid, body) for cid, body in bodies.items()])
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        8,
        8,
        0,
    )
    out = _records(client, batch.output_file_id)
    assert [r["custom_id"] for r in out] == list(bodies)  # input order
    for rec in out:
        alone = client.chat.completions.create(**bodies[rec["custom_id"]])
        got = rec["response"]
        assert got["status_code"] == 200 and rec["error"] is None
        assert got["request_id"] == got["body"]["id"]
        assert got["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert got["body"]["usage"]["completion_tokens"] == alone.usage.completion_tokens
        assert got["body"]["usage"]["prompt_tokens"] == alone.usage.prompt_tokens
    # The completions endpoint too.
    prompts = {
        f"c{i}": {"model": model, "prompt": f"one two {i}", "max_tokens": 5, "temperature": 0}
        for i in range(3)
    }
    batch = _run_batch(
        client, [_line(k, v, "/v1/completions") for k, v in prompts.items()], "/v1/completions"
    )
    for rec in _records(client, batch.output_file_id):
        alone = client.completions.create(**prompts[rec["custom_id"]])
        assert rec["response"]["body"]["choices"][0]["text"] == alone.choices[0].text


def test_bad_lines_go_to_the_error_file_and_the_rest_go_on(server):
    client = _client(server, KEY_A)
    model = client.models.list().data[0].id
    good = {**_chat(1), "model": model}
    lines = [
        _line("ok-1", good),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": good}),  # no custom_id
        _line("ok-1", good),  # duplicate
        _line("unknown-model", {**good, "model": "no-such-model"}),
        _line("wrong-url", {"model": model, "prompt": "hi"}, url="/v1/completions"),
        _line("too-long", {**good, "messages": [{"role": "user", "content": "ab " * 2000}]}),
        _line("streamed", {**good, "stream": True}),
        _line("ok-2", {**_chat(2), "model": model}),
    ]
    batch = _run_batch(client, lines)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        9,
        2,
        7,
    )
    out, err = _records(client, batch.output_file_id), _records(client, batch.error_file_id)
    assert [r["custom_id"] for r in out] == ["ok-1", "ok-2"]
    by_id = {r["custom_id"]: r for r in err if r["custom_id"] not in (None, "ok-1")}
    assert [r["error"]["code"] for r in err if r["custom_id"] is None] == [
        "invalid_json",
        "missing_custom_id",
    ]
    assert [r["error"]["code"] for r in err if r["custom_id"] == "ok-1"] == ["duplicate_custom_id"]
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["wrong-url"]["error"]["code"] == "invalid_url"
    assert by_id["too-long"]["response"]["status_code"] == 400
    assert by_id["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert by_id["streamed"]["error"]["code"] == "invalid_request"


def test_bad_uploads_are_400_and_an_oversized_one_413(server):
    client = _client(server, KEY_A)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", b'{"custom_id": "x"}\n'), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    for data in (b"a,b,c\n1,2,3\n", b"\xff\xfe\x00garbage", b"\n\n"):
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("in.jsonl", data), purpose="batch")
        assert e.value.body["code"] == "invalid_file"
    big = (_line("x", {"prompt": "y" * 1000}, "/v1/completions") + "\n") * (UPLOAD_LIMIT // 1000 + 10)
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", big.encode()), purpose="batch")
    assert e.value.status_code == 413 and "batch_max_upload_bytes" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"


def test_a_tenant_sees_only_its_own_files_and_batches(server):
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    model = a.models.list().data[0].id
    f = a.files.create(
        file=("a.jsonl", (_line("a1", {**_chat(0), "model": model}) + "\n").encode()), purpose="batch"
    )
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: b.files.retrieve(f.id),
        lambda: b.files.content(f.id),
        lambda: b.files.delete(f.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    assert batch.id in {x.id for x in a.batches.list()}
    with pytest.raises(openai.AuthenticationError):
        _client(server, "sk-wrong").files.list()
    done = _wait(a, batch.id)
    assert done.status == "completed"  # B's attempts changed nothing
    assert a.files.retrieve(f.id).id == f.id


def test_cancel_stops_the_batch(server):
    client = _client(server, KEY_A)
    model = client.models.list().data[0].id
    long = {"model": model, "prompt": "count", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    lines = [_line(f"c{i}", long, "/v1/completions") for i in range(60)]
    f = client.files.create(file=("c.jsonl", ("\n".join(lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    _wait(client, batch.id, until=("in_progress",))
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    out = _records(client, done.output_file_id)
    assert done.request_counts.completed == len(out) < 60
    assert all(r["response"]["status_code"] == 200 for r in out)


def test_sigkill_mid_batch_then_restart_finishes_every_line_once(tiny_model_path, tmp_path):
    stack = _stack(tiny_model_path, tmp_path / "batches", batch_max_inflight=2)
    lines = [
        _line(
            f"k{i}",
            {"prompt": f"n {i}", "max_tokens": 40, "ignore_eos": True, "temperature": 0},
            "/v1/completions",
        )
        for i in range(30)
    ]
    lines.insert(5, "{broken")
    srv = ServerProcess(stack).start()
    try:
        client = _client(srv, KEY_A)
        f = client.files.create(file=("k.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.proc.kill()  # SIGKILL: no drain, no shutdown hook
        srv.proc.wait(30)
    finally:
        srv.stop()
    with sqlite3.connect(tmp_path / "batches" / "index.sqlite") as db:  # what the kill left
        (kept,) = db.execute("SELECT COUNT(*) FROM results WHERE ok = 1").fetchone()
    assert 4 <= kept < 30
    again = ServerProcess(stack).start()
    try:
        client = _client(again, KEY_A)
        mid = client.batches.retrieve(batch.id)
        assert mid.status == "in_progress" and kept <= mid.request_counts.completed < 30
        done = _wait(client, batch.id)
        # The restarted server ran exactly the lines the first one had not finished.
        ran = [r for r in again.log_records("request finished") if r.get("status") == "ok"]
        assert len(ran) == 30 - kept, again.log()
        out, err = _records(client, done.output_file_id), _records(client, done.error_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"k{i}" for i in range(30))
        assert [r["error"]["code"] for r in err] == ["invalid_json"]
        assert (done.request_counts.completed, done.request_counts.failed) == (30, 1)
        for rec in out[:3] + out[-3:]:  # lines before and after the kill equal a request alone
            i = int(rec["custom_id"][1:])
            alone = client.completions.create(
                model=rec["response"]["body"]["model"],
                prompt=f"n {i}",
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert rec["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    finally:
        again.stop()


def test_a_batch_past_its_window_expires_and_reports_the_lines_it_did_not_run(tiny_model_path, tmp_path):
    """In process: a batch whose window is over when the runner reaches it runs nothing; every
    line is a `batch_expired` error (a batch that expires while running stops within a poll)."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    llm = LLM(_stack(tiny_model_path, tmp_path / "batches", batch_max_inflight=1))
    app = create_app(llm.engine.stack, ServerState(llm.engine.stack, AsyncEngine(llm.engine)))
    long = {"prompt": "count", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    data = "\n".join(_line(f"e{i}", long, "/v1/completions") for i in range(40)).encode()
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with TestClient(app) as c:
        store = app.state["batches"].store
        f = store.add_file("a", "batch", "e.jsonl", data)
        batch = store.create_batch("a", None, "/v1/completions", f["id"], 0, "24h", None)
        app.state["batches"].runner.wake()
        deadline = time.monotonic() + 30
        while (got := c.get(f"/v1/batches/{batch['id']}", headers=headers).json())["status"] != "expired":
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        out = [
            json.loads(x)
            for x in c.get(f"/v1/files/{got['output_file_id']}/content", headers=headers).text.splitlines()
        ]
        err = [
            json.loads(x)
            for x in c.get(f"/v1/files/{got['error_file_id']}/content", headers=headers).text.splitlines()
        ]
    assert got["expired_at"] is not None and out == []
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"e{i}" for i in range(40))
    assert got["request_counts"] == {"total": 40, "completed": len(out), "failed": len(err)}


def test_a_second_server_on_the_same_batch_dir_is_refused_in_one_line(server):
    with pytest.raises(RuntimeError) as e:
        ServerProcess(server.stack).start()  # the module's server holds its batch_dir
    assert "is in use by another server" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_batch_lines_reach_the_engine_at_batch_priority_or_lower(tiny_model_path, tmp_path):
    """In process, watching the scheduler: every line's engine request is background work, a
    line asking to be more urgent included; one asking for less urgency keeps it."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack.sampling_params import BATCH_PRIORITY
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    llm = LLM(_stack(tiny_model_path, tmp_path / "batches"))
    seen: dict[str, int] = {}
    add = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda seq: (
        seen.setdefault(seq.request.client_request_id, seq.request.priority),
        add(seq),
    )[1]
    app = create_app(llm.engine.stack, ServerState(llm.engine.stack, AsyncEngine(llm.engine)))
    asks = {"p-none": None, "p-urgent": -5, "p-zero": 0, "p-lower": BATCH_PRIORITY + 50}
    lines = [
        _line(
            cid,
            {"prompt": "hi", "max_tokens": 2, **({} if p is None else {"priority": p})},
            "/v1/completions",
        )
        for cid, p in asks.items()
    ]
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with TestClient(app) as c:
        f = c.post(
            "/v1/files",
            files={"file": ("p.jsonl", "\n".join(lines).encode())},
            data={"purpose": "batch"},
            headers=headers,
        )
        body = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = c.post("/v1/batches", json=body, headers=headers).json()
        deadline = time.monotonic() + 30
        while c.get(f"/v1/batches/{batch['id']}", headers=headers).json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        interactive = c.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={**headers, "X-Request-Id": "live"},
        )
        assert interactive.status_code == 200
    assert seen == {
        "p-none": BATCH_PRIORITY,
        "p-urgent": BATCH_PRIORITY,
        "p-zero": BATCH_PRIORITY,
        "p-lower": BATCH_PRIORITY + 50,
        "live": 0,
    }


def test_tenants_batches_run_side_by_side(tiny_model_path, tmp_path):
    """In process, two lines in flight: tenant A's long batch is running when tenant B creates a
    short one; B's lines get their share of the slots at once, so B completes while A still
    runs (one batch at a time, oldest first, would finish all of A first). Both answer every
    line."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    llm = LLM(_stack(tiny_model_path, tmp_path / "batches", batch_max_inflight=2))
    app = create_app(llm.engine.stack, ServerState(llm.engine.stack, AsyncEngine(llm.engine)))
    body = {"prompt": "count", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    auth = {name: {"Authorization": f"Bearer {key}"} for name, key in (("a", KEY_A), ("b", KEY_B))}

    def create(c, tenant: str, n: int) -> str:
        data = "\n".join(_line(f"{tenant}{i}", body, "/v1/completions") for i in range(n)).encode()
        f = c.post(
            "/v1/files", files={"file": ("x.jsonl", data)}, data={"purpose": "batch"}, headers=auth[tenant]
        )
        req = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        return c.post("/v1/batches", json=req, headers=auth[tenant]).json()["id"]

    def get(c, tenant: str, batch_id: str) -> dict:
        return c.get(f"/v1/batches/{batch_id}", headers=auth[tenant]).json()

    with TestClient(app) as c:
        a = create(c, "a", 60)
        deadline = time.monotonic() + 60
        while (got := get(c, "a", a))["request_counts"]["completed"] < 2:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        b = create(c, "b", 3)
        while (got_b := get(c, "b", b))["status"] != "completed":
            assert time.monotonic() < deadline, got_b
            time.sleep(0.05)
        got_a = get(c, "a", a)
        assert got_a["status"] == "in_progress", got_a
        assert got_a["request_counts"]["completed"] < 60
        while (got_a := get(c, "a", a))["status"] != "completed":
            assert time.monotonic() < deadline + 60, got_a
            time.sleep(0.1)
    assert got_b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert got_a["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
