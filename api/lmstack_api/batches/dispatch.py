"""One batch line through the server's own HTTP handlers, in process.

The line's request is handed to the Litestar app as an ASGI call, so it takes exactly the path an
HTTP client's does (authentication, validation, chat templates, tools, limits, error bodies),
with no socket. "The client" stays connected until `stop` is set: then the handler sees a
disconnect, aborts the engine requests and answers 499, which a batch never records (the line
runs again later).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from lmstack_api.batches.lines import Line, error_record, request_body, response_record

# What the server adopts as a caller's X-Request-Id (lmstack_api.state.client_request_id).
_TRACE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Answers that say "not now" rather than anything about the line: the line is retried.
RETRY_STATUSES = frozenset({408, 429, 499, 503})


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": {"message": self.body.decode("utf-8", "replace")[:500], "type": "server_error"}}

    def retry_after(self) -> float:
        try:
            return max(0.2, min(float(self.headers.get("retry-after", "1")), 30.0))
        except ValueError:
            return 1.0


async def call(app: Any, path: str, body: bytes, headers: dict[str, str], stop: asyncio.Event) -> Reply:
    """POST `body` to `path` of the ASGI `app`; the whole response."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await stop.wait()
        return {"type": "http.disconnect"}

    status, out_headers, chunks = 500, {}, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": raw_headers,
        "client": ("batch", 0),
        "server": ("lmstack-batch", 0),
        "state": {},
    }
    await app(scope, receive, send)
    return Reply(status, out_headers, b"".join(chunks))


async def run_line(app: Any, line: Line, headers: dict[str, str], stop: asyncio.Event) -> Reply:
    assert line.url is not None
    if line.custom_id is not None and _TRACE_ID.fullmatch(line.custom_id):
        # The server's request log then names the line (`client_request_id`).
        headers = {**headers, "x-request-id": line.custom_id}
    return await call(app, line.url, request_body(line), headers, stop)


def record_of(line: Line, reply: Reply) -> tuple[bool, dict[str, Any]]:
    """(ok, the output or error line) of a reply that is recorded."""
    body = reply.json()
    # The body's id is the server's own (unique); the header may be the custom_id echoed.
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return reply.status == 200, response_record(line.custom_id, reply.status, request_id, body)


def invalid_record(line: Line) -> tuple[bool, dict[str, Any]]:
    assert line.error is not None
    return False, error_record(line.custom_id, *line.error)
