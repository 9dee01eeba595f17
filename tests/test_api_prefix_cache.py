"""Prefix caching through the HTTP API: cached_tokens in usage, cache_salt, tenants (API keys),
metrics and the request log. One `lmstack serve` process with the `prefix` cache."""

from __future__ import annotations

import json

import httpx
import pytest

from lmstack.stack.plugins import build_registry, make_plugin_manager

pytestmark = pytest.mark.slow

KEYS = ["key-tenant-a", "key-tenant-b"]
STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "float32",
    "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256},
    "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
    "cache": {"name": "prefix"},
    "server": {"api_keys": KEYS},
}
PROMPT = "The bakery on the corner sells bread, cakes and coffee every morning from seven. " * 6


@pytest.fixture(scope="module")
def server(smollm2_path):
    if "prefix" not in build_registry(make_plugin_manager()).names("cache"):
        pytest.skip("lmstack-prefix-cache is not installed")
    from lmstack_api.testing import ServerProcess

    with ServerProcess(STACK) as s:
        yield s


def complete(server, key: str, **body) -> tuple[int, dict]:
    status, data, _ = server.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body},
        headers={"Authorization": f"Bearer {key}"},
    )
    return status, data


def cached(data: dict) -> int:
    return data["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_and_a_repeat_hits(server):
    status, first = complete(server, KEYS[0], cache_salt="s1")
    assert status == 200, first
    assert cached(first) == 0
    _, again = complete(server, KEYS[0], cache_salt="s1")
    assert cached(again) >= 16 and cached(again) < again["usage"]["prompt_tokens"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    _, other = complete(server, KEYS[0], cache_salt="s2")
    assert cached(other) == 0


def test_a_bad_cache_salt_is_a_400_naming_it(server):
    status, data = complete(server, KEYS[0], cache_salt="")
    assert status == 400 and data["error"]["param"] == "cache_salt"
    status, data = complete(server, KEYS[0], cache_salt=5)
    assert status == 400 and "cache_salt" in data["error"]["message"]


def test_tenants_never_share_a_prefix(server):
    from lmstack.sequence import Request

    if "tenant" not in Request.__dataclass_fields__:
        pytest.skip("Request.tenant (from the API key) is not in this lmstack yet")
    body = {"prompt": "Tenant check. " + PROMPT}
    _, a1 = complete(server, KEYS[0], **body)
    _, b1 = complete(server, KEYS[1], **body)
    _, a2 = complete(server, KEYS[0], **body)
    assert cached(a1) == 0
    assert cached(b1) == 0, "tenant B got a hit on tenant A's prefix"
    assert cached(a2) > 0


def test_chat_streaming_usage_metrics_and_log(server):
    body = {
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    usages = []
    for _ in range(2):
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            frames = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(frames[-1])["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    hits = server.metric("lmstack:prefix_cache_hits_total")
    queries = server.metric("lmstack:prefix_cache_queries_total")
    assert 0 < hits < queries
    lines = [json.loads(x) for x in server.log().splitlines() if '"request finished"' in x]
    assert any(line.get("cached_tokens", 0) > 0 for line in lines)
