"""One pass through the stack: `lmstack serve` and `lmstack check` load the plugins, resolve the
stack and open the model once, and the engine, its executor and the server build from that."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from lmstack import cli
from lmstack.engine.llm_engine import LLMEngine
from lmstack.model import source as source_module
from lmstack.stack import prepare as prepare_module
from lmstack.stack.prepare import PreparedStack, prepare_stack
from lmstack.testing.kit import tiny_stack


@pytest.fixture
def counts(monkeypatch):
    """How often this process opens a model source and resolves a stack."""
    seen = {"opened": 0, "resolved": 0}
    real_init, real_resolve = source_module.ModelSource.__init__, prepare_module.resolve

    def counting_init(self, *args, **kw):
        seen["opened"] += 1
        real_init(self, *args, **kw)

    def counting_resolve(*args, **kw):
        seen["resolved"] += 1
        return real_resolve(*args, **kw)

    monkeypatch.setattr(source_module.ModelSource, "__init__", counting_init)
    monkeypatch.setattr(prepare_module, "resolve", counting_resolve)
    return seen


def _stack(model_path) -> dict:
    return tiny_stack(model_path, allocator={"name": "paged", "block_size": 16, "num_blocks": 32})


def test_an_engine_from_a_stack_opens_its_model_once(tiny_model_path, counts):
    engine = LLMEngine(_stack(tiny_model_path))
    try:
        assert counts == {"opened": 1, "resolved": 1}
        assert engine.executor.spec.source is engine.source  # the executor loaded from it
    finally:
        engine.shutdown()


def test_a_prepared_stack_is_built_as_it_is(tiny_model_path, counts):
    prepared = prepare_stack(_stack(tiny_model_path))
    assert isinstance(prepared, PreparedStack) and counts == {"opened": 1, "resolved": 1}
    engine = LLMEngine(prepared)
    try:
        assert counts == {"opened": 1, "resolved": 1}
        assert engine.pm is prepared.plugin_manager and engine.stack is prepared.resolved
        assert engine.source is prepared.source and engine.models is prepared.models
    finally:
        engine.shutdown()


def test_the_servers_state_builds_the_engine_from_the_servers_pass(tiny_model_path, counts):
    from lmstack_api.state import ServerState

    prepared = prepare_stack(_stack(tiny_model_path))
    state = ServerState(prepared.resolved, prepared=prepared)
    asyncio.run(state.load())
    try:
        assert state.load_error is None
        assert state.engine.engine.source is prepared.source
        assert counts == {"opened": 1, "resolved": 1}
    finally:
        state.engine.shutdown()


def test_check_opens_the_model_once(tiny_model_path, counts, tmp_path, capsys):
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(_stack(tiny_model_path)))
    assert cli.main(["check", str(path)]) == 0
    assert counts == {"opened": 1, "resolved": 1}
    assert "ok" in capsys.readouterr().out
