"""lmstack: an LLM inference server built as a minimal core plus plugins."""

from __future__ import annotations

from lmstack._moved import install_moved_module_finder
from lmstack.plugin_api import PLUGIN_API_VERSION
from lmstack.sampling_params import SamplingParams

__all__ = ["LLM", "PLUGIN_API_VERSION", "AsyncEngine", "LLMEngine", "SamplingParams", "hookimpl"]

install_moved_module_finder()


def __getattr__(name: str):
    # Lazy: `import lmstack` (and the CLI) stays fast; torch loads only when the engine is used.
    if name == "LLM":
        from lmstack.engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from lmstack.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "LLMEngine":
        from lmstack.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "hookimpl":
        from lmstack.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(name)
