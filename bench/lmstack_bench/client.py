"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Raw SSE over httpx rather than the `openai` package: the benchmark needs the arrival time of every
chunk and must see a stream that ends without `[DONE]` as the error it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from lmstack_bench.metrics import RequestRecord

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class RequestOptions:
    model: str
    endpoint: str = "completions"
    temperature: float = 0.0
    # Generate exactly max_tokens: min_tokens = max_tokens and ignore_eos (lmstack and vLLM read
    # min_tokens, llama.cpp's server reads ignore_eos; each ignores the other).
    fixed_output: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose completions or chat")


def flatten(messages: list[dict[str, str]]) -> str:
    """A conversation as one completion prompt (the completions endpoint has no roles)."""
    if len(messages) == 1:
        return messages[0]["content"]
    if len(messages) == 2 and messages[0]["role"] == "system":
        return messages[0]["content"] + "\n\n" + messages[1]["content"]
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    lines = [f"{names[m['role']]}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def request_body(opts: RequestOptions, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = flatten(messages)
    if opts.fixed_output:
        body["min_tokens"] = max_tokens
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    return body


@dataclass
class Reply:
    record: RequestRecord
    text: str


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    opts: RequestOptions,
    messages: list[dict[str, str]],
    max_tokens: int,
    expected_prompt_tokens: int,
) -> Reply:
    """Send one streamed request and time it. Never raises for a server or network failure:
    the record carries the error instead."""
    path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
    body = request_body(opts, messages, max_tokens)
    rec = RequestRecord(start=time.perf_counter())
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with client.stream("POST", base_url + path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        continue
                    text = "".join(_chunk_text(c, opts.endpoint) for c in obj.get("choices") or ())
                    if text:
                        now = time.perf_counter()
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.chunk_times.append(now)
                        parts.append(text)
                    if obj.get("usage"):
                        usage = obj["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.end = time.perf_counter()
    if rec.error is None and not done:
        rec.error = "stream ended without [DONE]"
    if rec.error is None and rec.first_token is None:
        rec.error = "no text generated"
    # Servers that send no usage chunk: count text chunks (one token each without speculation).
    rec.output_tokens = int(usage["completion_tokens"]) if usage else len(rec.chunk_times)
    rec.prompt_tokens = int(usage["prompt_tokens"]) if usage else expected_prompt_tokens
    details = (usage or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]
    return Reply(record=rec, text="".join(parts))


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    except (json.JSONDecodeError, AttributeError):
        return raw[:200].decode("utf-8", "replace")
