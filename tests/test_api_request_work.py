"""Work one HTTP request may ask for (issue 60, item 4): prompts x n sequences and echoed
prompt logprobs are bounded (`server.max_request_sequences`, `server.max_prompt_logprob_tokens`),
past either a 400 naming the limit; within them the request is served, its prompts sharing
the engine as one call (`Request.group`). In process, on the tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("lmstack_api")


@pytest.fixture(scope="module")
def client(tiny_model_path):
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack.testing.kit import tiny_stack
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    stack = tiny_stack(
        tiny_model_path,
        allocator={"name": "paged", "block_size": 16, "num_blocks": 512},
        scheduler={"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 1024},
        server={"max_request_sequences": 48, "max_prompt_logprob_tokens": 600},
    )
    llm = LLM(stack)
    seen: list = []
    add = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda seq: (seen.append(seq.request), add(seq))[1]
    app = create_app(llm.engine.stack, ServerState(llm.engine.stack, AsyncEngine(llm.engine)))
    with TestClient(app) as c:
        c.seen = seen
        yield c


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_prompts_times_n_over_the_limit_is_400_naming_it(client):
    err = _error(client.post("/v1/completions", json={"prompt": ["a"] * 4000, "n": 32, "max_tokens": 1}))
    assert err["param"] == "prompt" and err["code"] == "too_many_sequences"
    assert "4000 prompts x 32 = 128000 sequences" in err["message"]
    assert "limit of 48 sequences per request (max_request_sequences)" in err["message"]
    err = _error(client.post("/v1/completions", json={"prompt": "a", "n": 49, "max_tokens": 1}))
    assert err["param"] == "n" and "asks for 49 sequences" in err["message"]
    err = _error(client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 5, "best_of": 25}))
    assert err["param"] in ("best_of", "prompt")  # best_of != n is refused either way
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 49, "max_tokens": 1}
    err = _error(client.post("/v1/chat/completions", json=chat))
    assert err["param"] == "n" and "max_request_sequences" in err["message"]


def test_within_the_limit_the_prompts_run_as_one_call(client):
    client.seen.clear()
    r = client.post(
        "/v1/completions",
        json={"prompt": ["the cat", "a dog", "hello"], "n": 16, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 48
    # Greedy: every one of a prompt's 16 sequences says what the prompt alone says.
    for p, prompt in enumerate(["the cat", "a dog", "hello"]):
        alone = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
        texts = {c["text"] for c in choices[p * 16 : (p + 1) * 16]}
        assert texts == {alone.json()["choices"][0]["text"]}
    requests = list({req.request_id: req for req in client.seen}.values())  # forks add seqs too
    assert len(requests) == 6
    groups = {req.group for req in requests[:3]}
    assert len(groups) == 1 and None not in groups  # the three prompts share one group
    assert all(req.group is None for req in requests[3:])  # a single prompt is a group of its own


def test_echoed_prompt_logprobs_are_bounded(client):
    ids = [[(7 * i + j) % 200 + 3 for j in range(250)] for i in range(3)]  # 750 prompt tokens
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    err = _error(client.post("/v1/completions", json=body))
    assert err["param"] == "logprobs" and err["code"] == "too_many_prompt_logprobs"
    assert "750 prompt tokens" in err["message"] and "limit of 600" in err["message"]
    assert "max_prompt_logprob_tokens" in err["message"]
    # Without echo the same prompts need no prompt logprobs: served.
    assert client.post("/v1/completions", json={**body, "echo": False}).status_code == 200
    # Within the bound: served, a logprob for every prompt token after the first.
    r = client.post("/v1/completions", json={**body, "prompt": ids[:2]})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 251 and lp["token_logprobs"][0] is None
