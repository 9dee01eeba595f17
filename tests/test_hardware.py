"""`dtype: auto` and the thread count: chosen from what this machine computes well."""

from __future__ import annotations

import json

import pytest
import torch

from lmstack.cli import main
from lmstack.errors import ConfigError
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


def test_an_isa_cap_hides_the_wider_flags_from_every_choice(monkeypatch):
    monkeypatch.setattr(
        hardware,
        "hardware_flags",
        lambda: frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16"}),
    )
    monkeypatch.delenv("LMSTACK_MAX_ISA", raising=False)
    assert hardware.auto_dtype(torch.device("cpu")).dtype == torch.bfloat16
    for no_cap in ("auto", "avx512", ""):
        monkeypatch.setenv("LMSTACK_MAX_ISA", no_cap)
        assert hardware.isa_cap() is None and "avx512f" in hardware.cpu_flags()
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx2")
    assert hardware.cpu_flags() == {"avx", "avx2", "fma", "f16c"}
    assert hardware.auto_dtype(torch.device("cpu")).dtype == torch.float32  # as on an AVX2 CPU
    assert hardware.cpu_description()["isa_cap"] == "avx2"
    monkeypatch.setenv("LMSTACK_MAX_ISA", "scalar")
    assert hardware.cpu_flags() == frozenset()
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx3")
    with pytest.raises(
        ConfigError, match="LMSTACK_MAX_ISA='avx3': expected one of auto, avx512, avx2, scalar"
    ):
        hardware.cpu_flags()


def test_a_bad_isa_cap_is_one_line_from_the_cli(monkeypatch, capsys):
    monkeypatch.setenv("LMSTACK_MAX_ISA", "sse9")
    assert main(["plugins"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: LMSTACK_MAX_ISA='sse9': expected one of")


def test_the_layer_ops_follow_the_isa_cap_at_run_time(monkeypatch):
    from lmstack.model.layer_ops import native

    ops = native()
    if ops is None or ops.best_isa() == 0:
        pytest.skip("the native layer ops are not built here, or this CPU has no AVX2 to cap")
    x, w = torch.randn(3, 96), torch.randn(96)
    avx2 = ops.rms_norm(x, w, 1e-5, None)
    monkeypatch.setenv("LMSTACK_MAX_ISA", "scalar")
    assert ops.best_isa() == 0
    scalar = ops.rms_norm(x, w, 1e-5, None)
    # The scalar build adds in the same order as the vector one (layer_ops.cpp): the same bits
    # through the other path.
    assert torch.equal(scalar, avx2)
