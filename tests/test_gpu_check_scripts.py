"""benchmarks/gpu/gpu_check.py and benchmarks/gpu/quant_gpu_sweep.py stay runnable: their --smoke modes
run every section on the CPU with the Triton interpreter (tiny sizes, timings meaningless), and
gpu_check's checks pass there (the engine on the CPU against transformers, the flash kernels,
the quantizers' GEMMs in the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


@pytest.mark.slow
def test_gpu_check_smoke_passes_every_check(tmp_path):
    pytest.importorskip("transformers")
    proc = _run("gpu_check.py", "--smoke", "--out", str(tmp_path), "--trials", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    for section in ("kernels", "engine", "timing"):
        assert isinstance(result[section], list), result[section]
    assert {r["kernel"] for r in result["kernels"]} == {"w4a16", "nvfp4"}
    assert all(r["ok"] for r in result["kernels"]), [r for r in result["kernels"] if not r["ok"]]
    failed = [r for r in result["engine"] if not r["ok"]]
    assert not failed, failed
    assert len(result["engine"]) == 7  # the CUDA-only comparisons are left out on the CPU


@pytest.mark.slow
def test_quant_gpu_sweep_smoke_runs(tmp_path):
    proc = _run("quant_gpu_sweep.py", "--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "quant_gpu_sweep.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    kernels = {r["kernel"] for r in rows}
    assert {"bf16", "w4a16.default", "w4a16.dequant", "w4a16.gemm", "nvfp4.gemm", "nvfp4.dequant"} <= kernels
    assert all(r["rel_error"] <= 2e-2 for r in rows if "rel_error" in r)
    tiles = [r for r in rows if r["kernel"] == "dequant_only"]
    assert tiles and all(r["same_as_default"] for r in tiles)
