"""`dtype: auto` and the thread count: chosen from what this machine computes well."""

from __future__ import annotations

import json

import pytest
import torch

from lmstack.cli import main
from lmstack.kernels import hardware
from lmstack.stack.config import load_stack
from lmstack.stack.plugins import default_registry
from lmstack.stack.resolve import resolve


@pytest.fixture
def flags(monkeypatch):
    """Pretend this CPU has the given flags."""

    def set_flags(*names: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(flags):
    flags("avx2", "avx512f", "avx512_bf16")
    choice = hardware.auto_dtype(torch.device("cpu"))
    assert choice.dtype == torch.bfloat16 and "avx512_bf16" in choice.reason
    flags("avx2", "amx_bf16")
    assert hardware.auto_dtype(torch.device("cpu")).dtype == torch.bfloat16
    flags("avx2", "avx512f")  # AVX-512 without its bf16 extension: still emulated
    choice = hardware.auto_dtype(torch.device("cpu"))
    assert choice.dtype == torch.float32 and "no native bfloat16" in choice.reason


def test_resolved_stack_says_what_auto_picked_and_why(flags):
    flags("avx2")
    resolved = resolve(load_stack({}), default_registry())
    assert resolved.dtype == torch.float32
    described = resolved.describe()
    assert described["dtype"] == "float32" and described["dtype_reason"].startswith("auto:")
    explicit = resolve(load_stack({"dtype": "bfloat16"}), default_registry())
    assert explicit.dtype == torch.bfloat16 and explicit.describe()["dtype_reason"] == "set in the stack"


def test_check_warns_of_bf16_on_a_cpu_without_it(flags, tmp_path, capsys):
    flags("avx2")
    stack = tmp_path / "s.yaml"
    stack.write_text("dtype: bfloat16\n")
    assert main(["check", "--skip-model", str(stack)]) == 0
    err = capsys.readouterr().err
    assert "warning: dtype: bfloat16 on a CPU without native bfloat16" in err
    stack.write_text("dtype: auto\n")
    assert main(["check", "--skip-model", str(stack)]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "auto: this CPU has no native bfloat16" in out
    assert main(["check", "--skip-model", "--json", str(stack)]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"


def test_usable_cpus_follows_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert hardware.usable_cpus() == 3
