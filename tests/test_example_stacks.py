"""Every stack under examples/stacks resolves with the installed plugins (what `lmstack check`
does before any weight loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmstack.stack.config import load_stack
from lmstack.stack.plugins import default_registry
from lmstack.stack.resolve import resolve

STACKS = sorted((Path(__file__).resolve().parent.parent / "examples" / "stacks").glob("*.yaml"))


@pytest.mark.parametrize("path", STACKS, ids=[p.stem for p in STACKS])
def test_example_stack_resolves(path):
    stack = load_stack(path)
    if stack.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("a GPU stack, and this machine has no CUDA device")
    _skip_unbuildable_cpu_paged(stack)
    resolved = resolve(stack, default_registry())
    assert resolved.describe()["model"]


def _skip_unbuildable_cpu_paged(stack) -> None:
    """cpu-paged compiles C++ on the machine; where it cannot (no compiler), resolution refuses
    its stack by design (tested in the plugin), so that stack is skipped here."""
    if "cpu-paged" not in {section["name"] for section in stack.attention.values()}:
        return
    try:
        from lmstack_cpu_paged.build import load_error
    except ImportError:
        pytest.skip("the cpu-paged attention plugin is not installed")
    if (problem := load_error()) is not None:
        pytest.skip(f"cpu-paged cannot be built here: {problem}")
