"""Speculative decoding through the HTTP API: `lmstack serve` with the `ngram` speculator shows
the drafter in /v1/stack and the spec-decode metrics in /metrics, and a `json_schema` request
returns valid JSON with the same text as a server without speculation (greedy); so does one
with the `eagle` speculator."""

from __future__ import annotations

import json

import pytest

from lmstack.stack.plugins import build_registry, make_plugin_manager

pytestmark = pytest.mark.slow

STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "float32",
    "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 512},
    "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
    # The dequantized checkpoint through the reference kernels, without prefix caching: what
    # this test was written against, not the defaults' autos (GGUF blocks, cpu-paged, prefix).
    "quant": {"weights": "none"},
    "attention": "torch",
    "cache": "none",
}
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "rivers": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "rivers"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers(smollm2_path):
    if "ngram" not in build_registry(make_plugin_manager()).names("speculator"):
        pytest.skip("lmstack-ngram is not installed")
    from lmstack_api.testing import ServerProcess

    with ServerProcess({**STACK, "speculator": {"name": "ngram", "adaptive": False}}) as spec:
        with ServerProcess(STACK) as plain:
            yield spec, plain


def chat(server, content: str, **body) -> dict:
    status, data, _ = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 60, **body},
    )
    assert status == 200, data
    return data


def assert_same_valid_json(spec, plain) -> None:
    """A json_schema request answers the same text with and without drafts, and it is valid."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    prompt = "Give a country and two of its rivers as JSON, for example France."
    ours = chat(spec, prompt, response_format=fmt)["choices"][0]["message"]["content"]
    theirs = chat(plain, prompt, response_format=fmt)["choices"][0]["message"]["content"]
    assert ours == theirs
    value = json.loads(ours)
    assert set(value) == {"name", "rivers"} and all(isinstance(r, str) for r in value["rivers"])


def test_stack_names_the_drafter_and_metrics_count_drafts(servers):
    spec, plain = servers
    status, body = spec.get("/v1/stack")
    assert status == 200
    described = json.loads(body)
    drafter = described["stack"]["components"]["speculator"]
    assert drafter["name"] == "ngram" and drafter["options"]["num_draft_tokens"] == 5
    prompt = f"Repeat this code exactly:\n\n{CODE}"
    ours, theirs = chat(spec, prompt), chat(plain, prompt)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    drafted = spec.metric("lmstack:spec_decode_num_draft_tokens_total")
    accepted = spec.metric("lmstack:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert spec.metric("lmstack:spec_decode_accepted_length_count") > 0
    assert spec.metric("lmstack:spec_decode_draft_length") >= 0
    assert plain.metric("lmstack:spec_decode_num_draft_tokens_total") == 0


def test_json_schema_with_drafts_is_valid_and_unchanged(servers):
    spec, plain = servers
    assert_same_valid_json(spec, plain)


@pytest.fixture(scope="module", params=["untrained", "bundled"])
def eagle_server(request, smollm2_path, tmp_path_factory):
    pytest.importorskip("lmstack_eagle")
    import torch

    from lmstack.model.source import open_model_source
    from lmstack_api.testing import ServerProcess
    from lmstack_eagle.head import EagleHead, HeadConfig, save_head

    if request.param == "untrained":
        # Its drafts meet the grammar's masks and the target's choices at random, so most are
        # rejected at some verified position.
        torch.manual_seed(0)
        config = HeadConfig.for_target(open_model_source("smollm2-135m-instruct").config)
        head = str(save_head(EagleHead(config), tmp_path_factory.mktemp("eagle-head")))
    else:
        # The head lmstack-eagle ships for SmolLM2: drafts accepted inside the grammar too.
        head = "smollm2-135m-instruct"
    spec = {"name": "eagle", "head": head, "adaptive": False, "num_draft_tokens": 3}
    with ServerProcess({**STACK, "speculator": spec}) as server:
        yield request.param, server


def test_json_schema_with_eagle_drafts_is_valid_and_unchanged(servers, eagle_server):
    _, plain = servers
    head, server = eagle_server
    status, body = server.get("/v1/stack")
    assert status == 200 and json.loads(body)["stack"]["components"]["speculator"]["name"] == "eagle"
    assert_same_valid_json(server, plain)
    assert server.metric("lmstack:spec_decode_num_draft_tokens_total") > 0
    if head == "bundled":
        assert server.metric("lmstack:spec_decode_num_accepted_tokens_total") > 0
