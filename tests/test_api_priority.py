"""Per-key scheduling priority (issue 59): an `api_keys` entry's default `priority` and its
ceiling `min_priority` (a more urgent request is clamped to it), through the HTTP app in-process
on the tiny model; the priority the scheduler receives is recorded."""

from __future__ import annotations

import pytest

from lmstack.errors import ConfigError

PLAIN = "sk-priority-plain-5c1e"  # a plain string: any priority, 0 by default
CHAT = "sk-priority-chat-77aa"  # {priority: 10, min_priority: 5}
BULK = "sk-priority-bulk-0f3b"  # {priority: 100, min_priority: 100}: background only
ENV = "sk-priority-env-9d20"  # LMSTACK_API_KEYS: as a plain key
KEYS = [
    PLAIN,
    {"key": CHAT, "tenant": "chat", "priority": 10, "min_priority": 5},
    {"key": BULK, "tenant": "bulk", "priority": 100, "min_priority": 100},
]


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
        allocator={"name": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256},
        server={"api_keys": KEYS},
    )
    llm = LLM(stack)
    seen: list = []
    add = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda seq: (seen.append(seq.request.priority), add(seq))[1]
    mp = pytest.MonkeyPatch()
    mp.setenv("LMSTACK_API_KEYS", ENV)
    state = ServerState(llm.engine.stack, AsyncEngine(llm.engine))
    mp.undo()
    with TestClient(create_app(llm.engine.stack, state)) as c:
        c.seen = seen
        yield c


# (key, body priority, X-Priority header, the priority the scheduler must see)
CASES = [
    (PLAIN, None, None, 0),
    (PLAIN, -4, None, -4),
    (PLAIN, None, "7", 7),
    (ENV, -2, None, -2),
    (CHAT, None, None, 10),  # the key's default
    (CHAT, 6, None, 6),  # within the ceiling
    (CHAT, 0, None, 5),  # more urgent than min_priority: clamped
    (CHAT, None, "-50", 5),  # the header too
    (CHAT, 40, "1", 40),  # the body wins over the header, as without keys
    (BULK, None, None, 100),
    (BULK, 0, None, 100),
    (BULK, 150, None, 150),  # less urgent is always allowed
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_key_sets_the_default_and_the_ceiling(client, path):
    for key, body_priority, header, expect in CASES:
        body = {"max_tokens": 1, "temperature": 0}
        body |= (
            {"prompt": "Hi"}
            if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "Hi"}]}
        )
        if body_priority is not None:
            body["priority"] = body_priority
        headers = {"Authorization": f"Bearer {key}"}
        if header is not None:
            headers["X-Priority"] = header
        client.seen.clear()
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert client.seen == [expect], (key, body_priority, header)


def test_a_bad_x_priority_is_still_a_400_under_a_key(client):
    r = client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"Authorization": f"Bearer {CHAT}", "X-Priority": "urgent"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"


def test_a_default_more_urgent_than_the_ceiling_is_a_config_error_without_the_key():
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import build_registry, make_plugin_manager
    from lmstack.stack.resolve import resolve

    registry = build_registry(make_plugin_manager(autoload=False, extra_plugins=["lmstack_api.plugin"]))
    secret = "sk-never-printed-4411"
    entry = {"key": secret, "tenant": "t", "priority": 0, "min_priority": 3}
    with pytest.raises(ConfigError) as info:
        resolve(load_stack({"server": {"api_keys": [entry]}}), registry, check_device=False)
    msg = str(info.value)
    assert "server.api_keys[0]" in msg and "priority 0 and min_priority 3" in msg, msg
    assert secret not in msg
