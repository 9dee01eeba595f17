"""Every stack under examples/stacks resolves with the installed plugins (what `lmstack check`
does before any weight loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmstack.config import load_stack
from lmstack.plugins import default_registry
from lmstack.resolve import resolve

STACKS = sorted((Path(__file__).resolve().parent.parent / "examples" / "stacks").glob("*.yaml"))


@pytest.mark.parametrize("path", STACKS, ids=[p.stem for p in STACKS])
def test_example_stack_resolves(path):
    stack = load_stack(path)
    if stack.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("a GPU stack, and this machine has no CUDA device")
    resolved = resolve(stack, default_registry())
    assert resolved.describe()["model"]
