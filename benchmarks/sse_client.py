"""A minimal streaming client for OpenAI-compatible `/v1/completions`, reading raw SSE so a
missing `[DONE]` or a short usage count is visible (the `openai` package hides both)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    ok: bool = False  # ended with [DONE], no error event, usage present
    done: bool = False
    error: str | None = None
    tokens_received: int = 0  # from per-token logprobs in the chunks
    usage_completion: int | None = None
    text: str = ""
    start: float = 0.0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def usage_matches(self) -> bool:
        return self.usage_completion is not None and self.usage_completion == self.tokens_received


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict,
    *,
    stop_after_chunks: int | None = None,
    count_tokens: bool = True,
) -> StreamResult:
    """POST a streamed completion and read until [DONE], or leave after `stop_after_chunks`
    chunks (a client that disconnects). `count_tokens` asks for logprobs=0 so every chunk
    lists its tokens and the usage count can be checked; without it (less server work, for
    throughput runs) the received count is taken from the usage chunk."""
    res = StreamResult(start=time.perf_counter())
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    if count_tokens:
        payload["logprobs"] = 0
    try:
        async with client.stream("POST", base_url + "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"]["message"]
                    continue
                for ch in obj.get("choices") or []:
                    res.text += ch.get("text") or ""
                    lp = ch.get("logprobs")
                    n = len(lp["tokens"]) if lp else int(not count_tokens)
                    if n:
                        now = time.perf_counter()
                        if res.first_token is None:
                            res.first_token = now
                        res.token_times.extend([now] * n)
                        res.tokens_received += n
                if obj.get("usage"):
                    res.usage_completion = obj["usage"]["completion_tokens"]
                chunks += 1
                if stop_after_chunks is not None and chunks >= stop_after_chunks:
                    break
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    if not count_tokens and res.usage_completion is not None:
        res.tokens_received = res.usage_completion
    res.ok = res.done and res.error is None and res.usage_matches
    return res
