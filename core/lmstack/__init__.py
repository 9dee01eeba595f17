"""lmstack: an LLM inference server built as a minimal core plus plugins."""

from __future__ import annotations

import os

# OpenMP threads that spin while waiting for work (libgomp's default spins ~300k rounds, ACTIVE
# forever) take the cores a busy neighbour needs, and then wait for each other: beside one
# other busy process 48 tokens took 66-75 s instead of ~1 s, with PASSIVE (sleep at once) 1.2 s.
# libgomp reads this once, when torch loads it, so it is set here, before anything imports
# torch; spawned workers inherit it. A user's own setting (ACTIVE for a dedicated machine) wins.
if not os.environ.get("OMP_WAIT_POLICY"):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

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
