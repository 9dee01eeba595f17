"""The HTTP API, end to end: a real `lmstack serve` process driven by the official `openai`
client (and raw HTTP where the client would hide what we check)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
STACK = {
    "model": MODEL,
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "scheduler": {"name": "continuous", "max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "128MiB"},
    "server": {"max_body_bytes": 1_000_000},
    # No prefix cache (on by default): a repeated request is computed again, in the same batch
    # shapes, so its bf16 greedy output is the first one's (a streamed and a non-streamed run
    # are compared below).
    "cache": "none",
}
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(STACK)  # test_bench_serve.py drives the same server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def assert_still_serving(client) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_health_is_503_until_the_model_is_loaded(server):
    assert server.health_seen[-2:] == [503, 200], server.health_seen


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body = server.get("/v1/stack")
    stack = json.loads(body)
    assert status == 200 and stack["model"] == MODEL
    assert stack["stack"]["components"]["scheduler"]["name"] == "continuous"
    # quant.weights: auto on a GGUF checkpoint with dtype bfloat16, which lmstack-gguf's kernels
    # do not take: the built-in quantizer, which reads it too.
    assert stack["stack"]["checkpoint_format"] == "gguf"
    assert stack["stack"]["components"]["quantizer"]["name"] == "none"
    assert stack["engine"]["max_model_len"] == 1024


def test_chat_non_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_matches_non_streamed_and_usage_counts_tokens(client):
    kw = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    received = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == received == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_streamed_and_not(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=12)
    whole = client.completions.create(**kw)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_prompt_forms_and_echo(client, server):
    texts = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in texts.choices) == [0, 1]
    ids = [19556, 28]  # token ids are accepted too
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 2 + 3 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith("".join(lp.tokens[:2]))


def test_stop_sequences(client):
    kw = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", temperature=0, max_tokens=20)
    free = client.completions.create(**kw).choices[0].text
    assert " 7" in free, free
    stopped = client.completions.create(**kw, stop=[" 7", "never"]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(" 7")]
    streamed = list(client.completions.create(**kw, stop=" 7", stream=True))
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_seed_reproducibility(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0,
        max_tokens=24,
    )
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    others = {client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_n_2(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=16,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == sum(
        len(c)
        for c in [
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name a fruit."}],
                n=2,
                temperature=1.0,
                seed=7,
                max_tokens=16,
                logprobs=True,
            )
            .choices[i]
            .logprobs.content
            for i in range(2)
        ]
    )


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # The end-of-turn token is a generated (and counted) token, but not part of the text.
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert t.logprob == pytest.approx(values[0])


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(client):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        assert r.choices[0].finish_reason == "stop"
        data = json.loads(r.choices[0].message.content)
        jsonschema.validate(data, PERSON)


def test_min_tokens_with_a_grammar_is_400(server):
    body = {"prompt": "JSON:", "min_tokens": 5, "response_format": {"type": "json_object"}}
    status, resp, _ = server.post("/v1/completions", body)
    assert _error(status, resp, 400, "min_tokens")["code"] == "unsupported"


def test_json_object_output(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object with a key 'city'."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# --- bad input: the right 4xx, the OpenAI error body, and the server keeps serving -----------


def _error(status, body, expected_status, param=None):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "x", "messages": [', None),  # malformed JSON
        (b"[1, 2]", None),  # not an object
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 1000}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 5}}, "logit_bias"),
    ],
)
def test_bad_chat_input_is_400(server, client, body, param):
    status, resp, _ = server.post("/v1/chat/completions", body)
    err = _error(status, resp, 400, param)
    assert err["type"] == "invalid_request_error"


def test_prompt_longer_than_context_is_400(server, client):
    status, resp, _ = server.post("/v1/completions", {"prompt": "hello " * 1500, "max_tokens": 4})
    err = _error(status, resp, 400, "prompt")
    assert "1024" in err["message"] and err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 1200}])
    assert_still_serving(client)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=FRANCE)
    assert e.value.body["code"] == "model_not_found"
    assert_still_serving(client)


def test_oversized_body_is_413(server, client):
    # Announce a 2 MB body but send only its start: the server must answer from the declared
    # length, without reading (a client still writing the rest could see the socket close).
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2_000_000))
    conn.endheaders(b'{"prompt": "' + b"x" * 1000)
    resp = conn.getresponse()
    _error(resp.status, json.loads(resp.read()), 413)
    conn.close()
    assert_still_serving(client)


def test_invalid_json_schema_is_400(server, client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, response_format=bad)
    assert e.value.body["param"].startswith("response_format")
    assert_still_serving(client)


def test_unknown_fields_are_ignored_and_unknown_routes_are_404(server, client):
    status, resp, headers = server.post(
        "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "some_future_field": {"a": 1}}
    )
    assert status == 200 and resp["usage"]["completion_tokens"] == 2
    assert headers["x-request-id"] == resp["id"]
    status, body = server.get("/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


# --- disconnects and concurrency -------------------------------------------------------------


def _wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_disconnected_streams_free_their_kv_blocks(server):
    """Clients that leave mid-stream: their requests are aborted and every block comes back."""
    aborted_before = server.metric("lmstack:request_aborted_total")
    body = {
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Barrier(6)

    def leave_early():
        with (
            httpx.Client(timeout=60) as h,
            h.stream("POST", server.base_url + "/v1/completions", json=body) as r,
        ):
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
        started.wait()

    threads = [threading.Thread(target=leave_early) for _ in range(5)]
    for t in threads:
        t.start()
    started.wait()
    for t in threads:
        t.join()
    assert _wait_for(lambda: server.metric("lmstack:kv_cache_blocks_used") == 0), server.get("/metrics")[1][
        -2000:
    ]
    assert server.metric("lmstack:num_requests_running") == 0
    assert server.metric("lmstack:request_aborted_total") == aborted_before + 5


def test_concurrent_streams_all_complete(server):
    async_client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    import asyncio

    async def one(i: int):
        stream = await async_client.completions.create(
            model=MODEL,
            prompt=f"Fact number {i}:",
            max_tokens=16 + i % 5,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
            if c.usage:
                usage = c.usage
        return text, usage, 16 + i % 5

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    assert all(u is not None and u.completion_tokens <= n for _, u, n in results)
    assert _wait_for(lambda: server.metric("lmstack:kv_cache_blocks_used") == 0)


def test_metrics_and_health(server, client):
    assert server.get("/health")[0] == 200
    client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    _, text = server.get("/metrics")
    text = text.decode()
    for name in (
        "lmstack:num_requests_running",
        "lmstack:num_requests_waiting",
        "lmstack:kv_cache_usage_perc",
        "lmstack:num_preemptions_total",
        "lmstack:prompt_tokens_total",
        "lmstack:generation_tokens_total",
        f'lmstack:request_finished_total{{finished_reason="stop",model_name="{MODEL}"}}',
        "lmstack:time_to_first_token_seconds_bucket",
        "lmstack:inter_token_latency_seconds_bucket",
        "lmstack:e2e_request_latency_seconds_bucket",
        "lmstack:request_queue_time_seconds_bucket",
        "lmstack:request_goodput_total",
        "lmstack:prefix_cache_queries_total",
        "lmstack:prefix_cache_hits_total",
    ):
        assert name in text, name
    assert server.metric("lmstack:generation_tokens_total") > 0
    # Every lmstack sample names the served model, as /v1/models reports it.
    served = json.loads(server.get("/v1/models")[1])["data"][0]["id"]
    samples = [line for line in text.splitlines() if line.startswith("lmstack:")]
    assert samples and all(f'model_name="{served}"' in line for line in samples), samples
    log = server.log()
    finished = [json.loads(line) for line in log.splitlines() if '"request finished"' in line]
    assert finished and {
        "request_id",
        "prompt_tokens",
        "completion_tokens",
        "ttft_s",
        "finish_reason",
    } <= set(finished[-1])
