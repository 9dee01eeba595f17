"""A batch input file's lines, and output / error lines in OpenAI's format.

Input, one JSON object a line: `{"custom_id": "...", "method": "POST", "url":
"/v1/chat/completions", "body": {...}}`. Output and error lines:
`{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}`: a request that ran has a `response` (in the error file when
its status is not 200); a line that could not be run has only an `error`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lmstack.sampling_params import BATCH_PRIORITY

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class Line:
    number: int  # 1-based, counting every line of the file (blank ones are skipped)
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None  # (code, message): the line cannot run


def read_lines(data: bytes, endpoint: str | None) -> list[Line]:
    """Every non-blank line of an input file, checked: each is either runnable or carries the
    error its error line will say. `endpoint`: the batch's (every url must be it); None accepts
    either endpoint (the offline form, where each line picks its own)."""
    text = data.decode("utf-8", errors="replace")
    out: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        out.append(_check(number, raw, endpoint, seen))
    return out


def _check(number: int, raw: str, endpoint: str | None, seen: set[str]) -> Line:
    try:
        item = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return Line(number, None, error=("invalid_json", f"line {number} is not valid JSON: {exc}"))
    if not isinstance(item, dict):
        return Line(number, None, error=("invalid_request", f"line {number} is not a JSON object"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, error=("missing_custom_id", f"line {number} has no custom_id (a string)"))
    if custom_id in seen:
        msg = f"line {number} repeats custom_id {custom_id[:64]!r}; each line needs its own"
        return Line(number, custom_id, error=("duplicate_custom_id", msg))
    seen.add(custom_id)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        return Line(number, custom_id, error=("invalid_method", f"line {number}: method must be POST"))
    allowed = (endpoint,) if endpoint is not None else ENDPOINTS
    if url not in allowed:
        want = " or ".join(allowed)
        msg = f"line {number}: url {str(url)[:64]!r} does not match the batch's endpoint {want}"
        return Line(number, custom_id, error=("invalid_url", msg))
    if not isinstance(body, dict):
        return Line(number, custom_id, error=("invalid_body", f"line {number}: body must be a JSON object"))
    if body.get("stream"):
        msg = f"line {number}: stream is not supported in a batch (the whole response is stored)"
        return Line(number, custom_id, error=("invalid_request", msg))
    return Line(number, custom_id, url, body)


def check_upload(data: bytes) -> int:
    """The number of non-blank lines of an upload; ValueError saying why it is not JSONL (not
    UTF-8, empty, or no line a JSON object). Single bad lines are accepted: each becomes its
    line's error when a batch runs, and the others go on."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the file is not UTF-8 text (byte {exc.start}); upload JSONL") from None
    count, objects = 0, 0
    for raw in text.splitlines():
        if not raw.strip():
            continue
        count += 1
        if not objects:
            try:
                objects += isinstance(json.loads(raw), dict)
            except (ValueError, RecursionError):
                pass
    if not count:
        raise ValueError("the file is empty; upload JSONL, one request a line")
    if not objects:
        raise ValueError("no line of the file is a JSON object; upload JSONL, one request a line")
    return count


def request_body(line: Line) -> bytes:
    """The line's body as sent to the endpoint: at batch priority or lower (a line cannot jump
    ahead of interactive traffic); a non-integer priority is left for the endpoint to refuse."""
    body = dict(line.body or {})
    given = body.get("priority")
    if given is None or (isinstance(given, int) and not isinstance(given, bool)):
        body["priority"] = max(BATCH_PRIORITY, given if given is not None else BATCH_PRIORITY)
    return json.dumps(body).encode()


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_record(custom_id: str | None, status: int, request_id: str | None, body: Any) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
