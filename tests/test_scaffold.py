"""`lmstack new-plugin`: the names it derives and refuses, the files it writes, and (slow) the
acceptance run: a package per kind, installed, listed, its tests green, and a stack selecting
every one of them generating text on the tiny model."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmstack import cli
from lmstack.commands import new_plugin as scaffold
from lmstack.roles import KIND_NAMES
from lmstack.stack.config import load_stack


def test_every_kind_has_a_template():
    # A kind added to lmstack.roles needs its template before new-plugin can make it.
    assert sorted(scaffold.TEMPLATES) == sorted(KIND_NAMES)


@pytest.mark.parametrize("name", ["Demo", "my_plugin", "-x", "x-", "a--b", "9lives", "ü", "", "a" * 41])
def test_bad_names_are_refused_with_the_rule(name):
    with pytest.raises(scaffold.ScaffoldError) as info:
        scaffold.write_plugin("scheduler", name, "unused")
    assert "lowercase letters, digits and single dashes" in str(info.value) or "longer than" in str(
        info.value
    )


def test_the_core_s_own_names_are_refused():
    with pytest.raises(scaffold.ScaffoldError, match="attention 'torch' is one of lmstack's own components"):
        scaffold.render("attention", "torch")
    scaffold.render("scheduler", "torch")  # names are per kind


def test_names_derived_from_name_and_kind():
    names = scaffold.PluginNames("speculator", "fair-share2")
    assert names.distribution == "lmstack-fair-share2-speculator"
    assert names.package == "lmstack_fair_share2_speculator"
    assert names.entry_point == "fair-share2-speculator"
    assert names.camel == "FairShare2"
    assert names.test_file == "test_fair_share2_speculator.py"


def test_unknown_kind_names_the_kinds(capsys):
    assert cli.main(["new-plugin", "sched", "demo"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "error: unknown kind 'sched'; lmstack new-plugin makes one of: scheduler, allocator"
    )


def test_never_overwrites(tmp_path, capsys):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert cli.main(["new-plugin", "scheduler", "demo", "--dir", str(target)]) == cli.EXIT_ERROR
    assert "already exists and is not empty; new-plugin never overwrites" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def test_writes_into_an_empty_folder_and_prints_next_steps(tmp_path, capsys):
    target = tmp_path / "empty"
    target.mkdir()
    assert cli.main(["new-plugin", "attention", "fast-kv", "--dir", str(target)]) == 0
    out = capsys.readouterr().out
    assert f'pip install -e "{target}[test]"' in out
    assert f"python -m pytest {target / 'tests'}" in out
    assert "attention: {prefill: fast-kv, decode: fast-kv}" in out
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == [
        "README.md",
        "lmstack_fast_kv_attention/__init__.py",
        "pyproject.toml",
        "tests/test_fast_kv_attention.py",
    ]


def test_default_folder_is_the_distribution_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["new-plugin", "parallel", "demo"]) == 0
    assert (tmp_path / "lmstack-demo-parallel" / "pyproject.toml").is_file()
    # A relative folder is printed as a path pip cannot take for a package name.
    assert 'pip install -e "./lmstack-demo-parallel[test]"' in capsys.readouterr().out


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_generated_package(kind):
    files = scaffold.render(kind, "demo")
    module = files[f"lmstack_demo_{kind}/__init__.py"]
    pyproject = files["pyproject.toml"]
    # The component registers through its kind's hook, declares the API range, and extends the
    # reference component the kind's roles default to.
    hook = scaffold.KIND[kind].hook
    assert f"def {hook}(register) -> None:" in module
    assert f'api="{scaffold.plugin_api_range()}"' in module
    assert f"class Demo{scaffold.TEMPLATES[kind].suffix}({scaffold.TEMPLATES[kind].base}):" in module
    assert f'\n[project.entry-points.lmstack]\ndemo-{kind} = "lmstack_demo_{kind}"\n' in pyproject
    assert '"lmstack>=0.1,<0.2"' in pyproject  # lmstack 0.2 may carry plugin API 2
    tests = files[f"tests/test_demo_{kind}.py"]
    assert (
        f"class TestDemo{scaffold.TEMPLATES[kind].suffix}Conformance({kind.capitalize()}Conformance):"
        in tests
    )
    assert 'component = "demo"' in tests
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_generated_code_imports_only_the_plugin_api(kind):
    from lmstack.plugin_api import PUBLIC_API

    files = scaffold.render(kind, "demo")
    imported = []
    for path in (f"lmstack_demo_{kind}/__init__.py", f"tests/test_demo_{kind}.py"):
        for node in ast.walk(ast.parse(files[path])):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("lmstack."):
                imported += [(node.module, alias.name) for alias in node.names]
    assert ("lmstack.testing", f"{kind.capitalize()}Conformance") in imported
    for module_name, name in imported:
        # `from lmstack.components import paged` imports the public module itself.
        public = f"{module_name}.{name}" in PUBLIC_API or name in PUBLIC_API.get(module_name, ())
        assert public, f"{kind}: {module_name}.{name} is not in lmstack.plugin_api.PUBLIC_API"


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_generated_stack_selects_every_role_of_the_kind(kind):
    stack = load_stack(scaffold.stack_selection(kind, "demo"))
    selected = {
        "scheduler": [stack.scheduler["name"]],
        "allocator": [stack.allocator["name"]],
        "attention": [stack.attention["prefill"]["name"], stack.attention["decode"]["name"]],
        "quantizer": [stack.quant["weights"]],
        "speculator": [stack.speculator["name"]],
        "parallel": [stack.parallel["name"]],
        "cache": [stack.cache["name"]],
    }
    assert selected[kind] and set(selected[kind]) == {"demo"}


def test_generated_code_passes_ruff_under_its_own_config(tmp_path):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    for kind in KIND_NAMES:
        target = scaffold.write_plugin(kind, "demo", tmp_path / kind)
        for args in (["check", "-q", "."], ["format", "-q", "--check", "."]):
            done = subprocess.run([ruff, *args], cwd=target, capture_output=True, text=True)
            assert done.returncode == 0, f"{kind}: ruff {args[0]}: {done.stdout}{done.stderr}"


# --- acceptance --------------------------------------------------------------------------------


def _run(args: list, env: dict, cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


@pytest.mark.slow
def test_a_generated_plugin_of_every_kind_installs_lists_passes_its_tests_and_generates(
    tmp_path, tiny_model_path
):
    env = {
        k: v for k, v in os.environ.items() if k not in ("LMSTACK_PLUGINS", "LMSTACK_DISABLE_PLUGIN_AUTOLOAD")
    }
    dirs = {kind: tmp_path / f"demo-{kind}" for kind in KIND_NAMES}
    # The command itself, once per kind; one process, so torch is imported once.
    calls = ", ".join(f"['new-plugin', '{kind}', 'demo', '--dir', r'{d}']" for kind, d in dirs.items())
    _run(
        [sys.executable, "-c", f"from lmstack.cli import main; assert all(main(a) == 0 for a in [{calls}])"],
        env,
        tmp_path,
    )

    # Installed side by side into a folder of their own (the CI's environment stays untouched):
    # lmstack finds their entry points through the *.dist-info there.
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    _run([*pip, "--target", site, *dirs.values()], env, tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])

    rows = json.loads(_run([sys.executable, "-m", "lmstack.cli", "plugins", "--json"], env, tmp_path))
    listed = {(r["kind"], r["distribution"]) for r in rows if r["name"] == "demo"}
    assert listed == {(kind, f"lmstack-demo-{kind}") for kind in KIND_NAMES}

    # Every package's own tests (kit + end-to-end), in one pytest run from outside the repository.
    tests = [d / "tests" for d in dirs.values()]
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env, tmp_path)

    stack = tmp_path / "demo.yaml"
    stack.write_text(
        f"model: {tiny_model_path}\ndtype: float32\n"
        "allocator: {name: demo, kv_cache_memory: 16MiB}\n"
        + "".join(
            f"{line}\n"
            for kind in KIND_NAMES
            if kind != "allocator"
            for line in scaffold.yaml_flow(scaffold.stack_selection(kind, "demo"))
        )
    )
    text = _run(
        [sys.executable, "-m", "lmstack.cli", "generate", "--stack", stack, "--max-tokens", "6", "Hello"],
        env,
        tmp_path,
    )
    assert text.strip()
