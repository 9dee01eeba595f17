"""Tool calling on /v1/chat/completions, end to end: a real `lmstack serve` driven by the
official `openai` client. On SmolLM2, whose template knows no tools (lmstack's generic
rendering: a JSON array of calls), and on the tiny Llama with a template of each family that
takes tools: Hermes (`<tool_call>` blocks), Llama 3 (`{"name": ..., "parameters": ...}`) and
Mistral (`[TOOL_CALLS][...]`), each forced and parsed in its own format, and pythonic
(`[f(a=1)]`), whose forced calls are the generic array. Arguments are checked against the functions' schemas with
jsonschema; streamed and whole answers are compared (greedy decoding)."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
# test_api_server.py's stack: the session's shared server serves both modules.
STACK = {
    "model": MODEL,
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "scheduler": {"name": "continuous", "max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "128MiB"},
    "server": {"max_body_bytes": 1_000_000},
    "cache": "none",
}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in UTC?"}]


def tiny_stack(path) -> dict:
    return {
        "model": str(path),
        "dtype": "float32",
        "max_model_len": 2048,
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "32MiB"},
        "cache": "none",
    }


@pytest.fixture(scope="module")
def smol(shared_server):
    server = shared_server(STACK)
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0), MODEL, 80


# The tiny models' template styles (lmstack.testing.tiny_tools), each its family's call format.
TINY_STYLES = ("hermes", "llama3_json", "mistral", "pythonic")


@pytest.fixture(scope="module", params=["smol", *TINY_STYLES])
def served(request, tmp_path_factory):
    """(client, model, max_tokens for a call): SmolLM2, or a tiny model with a `tiny_tools`
    template (module scope: pytest runs one style's tests together, one server at a time)."""
    if request.param == "smol":
        yield request.getfixturevalue("smol")
        return
    from lmstack.testing.tiny_tools import write_tiny_tool_model
    from lmstack_api.testing import ServerProcess

    path = write_tiny_tool_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), style=request.param)
    with ServerProcess(tiny_stack(path)) as server:
        # The random model spends ~1 token per byte: a larger budget.
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0), str(path), 400


def check_calls(calls, names=None) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking ids and the arguments' schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    if names is not None:
        assert [n for n, _ in out] == names
    return out


def streamed(client, **kw):
    """The official client's stream helper: its final message assembled from the fragments."""
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion().choices[0]


@pytest.mark.parametrize(
    "choice, names",
    [
        ("required", None),
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ],
)
def test_forced_calls_validate_and_stream_the_same(served, choice, names):
    client, model, budget = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=budget)
    if model != MODEL:
        # The random tiny model, offered more calls after each, would go on until max_tokens.
        kw["parallel_tool_calls"] = False
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content is None
    calls = check_calls(whole.message.tool_calls, names)
    assert calls
    again = streamed(client, **kw)
    assert again.finish_reason == "tool_calls"
    assert again.message.content in (None, "")
    assert check_calls(again.message.tool_calls) == calls


def test_parallel_tool_calls_false_gives_one_call(served):
    client, model, budget = served
    kw = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=budget
    )
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls"
    assert len(check_calls(one.message.tool_calls)) == 1


def test_parallel_calls_to_two_tools(smol):
    # Sampled answers under the grammar: with parallel_tool_calls (the default) an answer may
    # hold several calls, each valid; seed 1 of SmolLM2 gives one with two.
    client, model, budget = smol
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=budget, n=8)
    choices = client.chat.completions.create(**kw, temperature=1.0, seed=1).choices
    assert {c.finish_reason for c in choices} == {"tool_calls"}
    counts = [len(check_calls(c.message.tool_calls)) for c in choices]
    assert min(counts) >= 1 and max(counts) >= 2, counts


def test_tool_choice_none_returns_no_calls(served):
    client, model, budget = served
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12
    )
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    assert isinstance(c.message.content, str)


def test_a_tool_result_gets_a_final_answer(served):
    client, model, budget = served
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=budget,
    ).choices[0]
    (call,) = first.message.tool_calls
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=24
    ).choices[0]
    assert final.finish_reason in ("stop", "length")
    assert final.message.tool_calls is None and final.message.content


def test_auto_parses_the_models_own_call(smol):
    # auto leaves the text free; a forced call's text fed back as an earlier turn shows the
    # model the format, and whatever it writes is either content or calls that name a tool.
    client, model, _ = smol
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=60
    )
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400(smol):
    client, model, _ = smol
    bad = [
        dict(tools=[{"type": "retrieval"}]),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=TOOLS, tool_choice="sometimes"),
        dict(
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)
        assert err.value.status_code == 400 and err.value.body["param"], extra
