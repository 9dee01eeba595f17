"""Every script under benchmarks/ answers `--help` (so a reader can find its options and a moved or
broken import shows up here, not in the middle of a long run), and none borrows another script's
helpers through `sys.path`: what scripts share lives in `lmstack_bench.toolbox`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.rglob("*.py") if "results" not in p.parts and p.name != "__init__.py")
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\b|\[|\+=)")


def _help(script: Path) -> subprocess.CompletedProcess:
    # A run outside the repository's root, so a script that finds files relative to the working
    # directory instead of to itself fails here too.
    return subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS.parent / "tests",
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def test_the_scripts_are_found():
    folders = {p.parent.name for p in SCRIPTS}
    assert {"e2e", "kernels", "quality", "ab", "gpu", "peers"} <= folders, folders
    assert not [p for p in BENCHMARKS.glob("*.py")], "scripts belong in one of the folders"


def test_the_readme_lists_every_script():
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = [*SCRIPTS, *BENCHMARKS.glob("*/*.sh")]
    missing = [
        str(p.relative_to(BENCHMARKS)) for p in scripts if f"`{p.relative_to(BENCHMARKS)}`" not in readme
    ]
    assert not missing, missing


def test_every_script_answers_help():
    # The scripts are independent processes, mostly waiting on imports: run them side by side.
    with ThreadPoolExecutor(max_workers=max(2, (os.cpu_count() or 2) * 2)) as pool:
        done = dict(zip(SCRIPTS, pool.map(_help, SCRIPTS)))
    failed = {
        str(p.relative_to(BENCHMARKS)): (r.stdout + r.stderr)[-1500:]
        for p, r in done.items()
        if r.returncode != 0 or "usage:" not in r.stdout
    }
    assert not failed, failed


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_no_script_edits_sys_path(script):
    found = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(script.read_text().splitlines(), 1)
        if SYS_PATH_EDIT.search(line)
    ]
    assert not found, found


def test_the_toolbox_names_results_by_script_date_and_machine_kind(tmp_path, monkeypatch):
    from lmstack_bench import toolbox

    assert toolbox.cpu_kind({"avx2", "avx512f", "amx_tile"}) == "amx"
    assert toolbox.cpu_kind({"avx2", "avx512f", "avx512_bf16"}) == "avx512"
    assert toolbox.cpu_kind({"avx2", "fma"}) == "avx2"
    assert toolbox.gpu_kind("NVIDIA H200") == "h200"
    assert toolbox.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    # The default folder is under the checkout the script runs from, named <script>-<date>-<kind>.
    (tmp_path / "benchmarks" / "e2e").mkdir(parents=True)
    (tmp_path / "core").mkdir()
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "benchmarks" / "e2e" / "x.py")])
    folder = toolbox.result_dir("x", tag="quick", kind="avx2")
    assert folder.parent == tmp_path / "benchmarks" / "results"
    assert re.fullmatch(r"x-\d{4}-\d\d-\d\d-avx2-quick", folder.name) and folder.is_dir()
    assert toolbox.result_dir("x", out=tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert [toolbox.ab_order(["a", "b", "c"], r) for r in range(2)] == [["a", "b", "c"], ["c", "b", "a"]]


def test_a_run_under_an_isa_cap_is_filed_as_a_stand_in_and_builds_the_peer_for_that_cap(
    tmp_path, monkeypatch
):
    from lmstack_bench import toolbox

    from lmstack.kernels import hardware

    monkeypatch.setattr(
        hardware, "hardware_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    )
    monkeypatch.delenv("LMSTACK_MAX_ISA", raising=False)
    assert toolbox.cpu_kind() == "avx512" and toolbox.isa_cap() is None
    assert "-DGGML_NATIVE=ON" in toolbox.llama_build_commands(tmp_path, "0.3.36", 2)[1]
    assert toolbox.llama_build_folder(tmp_path) == tmp_path / "build"
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx2")
    # Judged as the AVX2 class (no avx512f in the flags the targets read), filed apart from it.
    assert toolbox.cpu_flags() == {"avx2", "fma"} and toolbox.cpu_kind() == "avx2-capped"
    configure = toolbox.llama_build_commands(tmp_path, "0.3.36", 2)[1]
    assert (
        "-DGGML_NATIVE=OFF" in configure
        and "-DGGML_AVX512=OFF" in configure
        and "-DGGML_AVX2=ON" in configure
    )
    assert configure[configure.index("-B") + 1] == str(tmp_path / "build-avx2")
    machine = toolbox.machine_info()
    assert machine["isa_cap"] == "avx2" and "avx512f" in machine["hardware_flags"]
    assert "avx512f" not in machine["cpu_flags"] and machine["cpu_kind"] == "avx2-capped"
    monkeypatch.setattr(sys, "argv", ["benchmarks/e2e/x.py", "--quick"])
    assert toolbox.command_line().startswith("LMSTACK_MAX_ISA=avx2 ")
    assert toolbox.command_line().endswith("python benchmarks/e2e/x.py --quick")
