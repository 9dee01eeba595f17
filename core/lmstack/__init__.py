"""lmstack: an LLM inference server built as a minimal core plus plugins."""

from __future__ import annotations

import os

# OpenMP threads that spin while waiting for work take the cores a busy neighbour needs, and
# then wait for each other: libgomp's default (300k spins before sleeping) took 2-10 s for 48
# tokens beside two busy processes on a 2-core Zen 4 and 66-75 s in the probe. Sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) bounds that (1.1 s) but doubles a quiet machine's batch-1 decode
# (0.82-0.98 s against 0.37-0.55): every step wakes its threads many times. A short spin keeps
# both: 3000 spins, 0.40 s quiet, 2.0 s beside the two busy processes (2026-12-06, the default
# stack decoding 48 greedy tokens at batch 1, medians of 3-7 runs). libgomp
# reads it once, when torch loads it, so it is set here, before anything imports torch; spawned
# workers inherit it. A user's own setting (OMP_WAIT_POLICY or GOMP_SPINCOUNT) wins.
if not os.environ.get("OMP_WAIT_POLICY") and not os.environ.get("GOMP_SPINCOUNT"):
    os.environ["GOMP_SPINCOUNT"] = "3000"

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
