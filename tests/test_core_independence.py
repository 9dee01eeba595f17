"""The core knows no distribution: lmstack-api, lmstack-bench and lmstack-calibrate plug into it,
never the reverse."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "core" / "lmstack"
OTHERS = ("lmstack_api", "lmstack_bench", "lmstack_calibrate")

# Run the CLI in a process where importing any of them fails, as if it were not installed.
BLOCKED_CLI = f"""
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {OTHERS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None

sys.meta_path.insert(0, _NotInstalled())
from lmstack.cli import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in {OTHERS!r})
assert not leaked, leaked
sys.exit(code)
"""


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def test_nothing_under_core_imports_the_api_the_benchmark_or_calibrate():
    offenders = {
        str(p.relative_to(CORE)): sorted(_imports(p) & set(OTHERS)) for p in sorted(CORE.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 20  # the scan saw the core


def _run(*args: str, stack: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMSTACK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_CLI, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_quantize_without_calibrate_names_the_distribution():
    quantize = _run("quantize", "--stack", "stack.yaml", "--method", "awq", "--out", "out")
    assert quantize.returncode == 2
    assert quantize.stderr.strip().splitlines() == [
        "error: unknown command 'quantize': it comes from the lmstack-calibrate distribution, which is "
        "not installed or not loaded (install it, and check LMSTACK_DISABLE_PLUGIN_AUTOLOAD / LMSTACK_PLUGINS)"
    ]


@pytest.mark.slow
def test_plugins_check_and_generate_without_api_or_bench(tmp_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "model: smollm2-135m-instruct\ndtype: float32\n"
        "scheduler: {max_num_seqs: 4, max_num_batched_tokens: 256}\n"
        "allocator: {num_blocks: 64}\n"
    )
    plugins = _run("plugins")
    assert plugins.returncode == 0, plugins.stderr
    assert "continuous" in plugins.stdout and "paged" in plugins.stdout

    check = _run("check", str(stack))
    assert check.returncode == 0, check.stderr
    assert "ok: the stack fits the model" in check.stdout

    gen = _run("generate", "--stack", str(stack), "--max-tokens", "8", "What is the capital of France?")
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in gen.stdout

    # The commands those distributions add are missing, with a one-line way out.
    serve = _run("serve", str(stack))
    assert serve.returncode == 2
    assert serve.stderr.strip().splitlines() == [
        "error: unknown command 'serve': it comes from the lmstack-api distribution, which is not "
        "installed or not loaded (install it, and check LMSTACK_DISABLE_PLUGIN_AUTOLOAD / LMSTACK_PLUGINS)"
    ]
    # A `server:` section needs the plugin that declares it.
    stack.write_text("server: {port: 8001}\n")
    check = _run("check", str(stack), "--skip-model")
    assert check.returncode == 2
    assert check.stderr.startswith("error: server: unknown key;")
