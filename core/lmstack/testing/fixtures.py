"""Pytest fixtures for plugin tests, loaded automatically where lmstack is installed (a
``pytest11`` entry point); a test module can also name it: ``pytest_plugins =
["lmstack.testing.fixtures"]``.

- `tiny_model_path`: a tiny random-weight Llama written once per session
  (`lmstack.testing.tiny_model`), for end-to-end tests without downloads:
  ``LLM({"model": str(tiny_model_path)})``.
- `tiny_moe_path`: a tiny random-weight Mixtral written by transformers itself
  (`lmstack.testing.tiny_moe`; skipped where transformers is not installed).

Importing this module imports no torch: it is loaded into every pytest run.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmstack.testing.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from lmstack.testing.tiny_moe import write_tiny_moe

    return write_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
