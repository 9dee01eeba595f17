"""The shape of the code, read from its imports and files: a core grouped by concern that knows
no plugin, and plugins that keep to the public API (`lmstack.plugin_api.PUBLIC_API`) and declare
the distributions they import."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import lmstack
from lmstack._moved import MOVED
from lmstack.plugin_api import PUBLIC_API

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "lmstack"

MAX_TOP_LEVEL_MODULES = 15
MAX_MODULE_LINES = 550
# Modules allowed past MAX_MODULE_LINES, and why (path relative to core/lmstack).
LONG_MODULES = {
    # The skeleton `lmstack new-plugin` writes: mostly the template files' text.
    "commands/new_plugin.py": "templates of a plugin's files",
}


def _distributions() -> dict[str, Path]:
    """Every distribution in the repository but the core: its import package -> its folder."""
    found = {}
    for pyproject in sorted(ROOT.glob("*/pyproject.toml")) + sorted(ROOT.glob("*/*/*/pyproject.toml")):
        folder = pyproject.parent
        if folder.name == "core" or ".venv" in folder.parts or "benchmarks" in folder.parts:
            continue
        for pkg in folder.iterdir():
            if pkg.is_dir() and (pkg / "__init__.py").exists() and pkg.name.startswith("lmstack"):
                found[pkg.name] = folder
    return found


DISTRIBUTIONS = _distributions()


def _imports(path: Path):
    """(module, name or None) for every absolute import in a file; name None for `import m`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name


def _declared(folder: Path) -> set[str]:
    """Distributions a pyproject depends on (required or optional), normalised to import names."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {re.split(r"[\s<>=!~;\[]", s, maxsplit=1)[0].lower().replace("-", "_") for s in specs}


def _dist_name(folder: Path) -> str:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"].lower().replace("-", "_")


def test_the_scan_sees_every_distribution():
    for pkg in ("lmstack_api", "lmstack_bench", "lmstack_calibrate", "lmstack_gguf", "lmstack_eagle"):
        assert pkg in DISTRIBUTIONS
    assert len(DISTRIBUTIONS) >= 18


def test_nothing_under_core_imports_a_plugin():
    offenders = {}
    for path in sorted(CORE.rglob("*.py")):
        bad = sorted({m for m, _ in _imports(path) if m.partition(".")[0] in DISTRIBUTIONS})
        if bad:
            offenders[str(path.relative_to(CORE))] = bad
    assert offenders == {}


def test_the_core_top_level_stays_small():
    modules = sorted(p.name for p in CORE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_no_core_module_is_long_without_a_reason():
    long = {
        str(p.relative_to(CORE)): n
        for p in sorted(CORE.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert {k: v for k, v in long.items() if k not in LONG_MODULES} == {}
    assert set(LONG_MODULES) <= set(long) | {k for k in LONG_MODULES if (CORE / k).exists()}


def _public(module: str, name: str | None) -> bool:
    if name is None:  # `import lmstack.x`
        return module == "lmstack" or module in PUBLIC_API
    if module == "lmstack":
        return name in lmstack.__all__ or f"lmstack.{name}" in PUBLIC_API
    return name in PUBLIC_API.get(module, ()) or f"{module}.{name}" in PUBLIC_API


@pytest.mark.parametrize("package", sorted(DISTRIBUTIONS))
def test_distributions_import_only_the_public_api(package):
    folder = DISTRIBUTIONS[package]
    private = set()
    for path in sorted((folder / package).rglob("*.py")):
        for module, name in _imports(path):
            if module.partition(".")[0] == "lmstack" and not _public(module, name):
                private.add(f"{path.relative_to(folder)}: {module}" + (f".{name}" if name else ""))
    assert sorted(private) == []


@pytest.mark.parametrize("package", sorted(DISTRIBUTIONS))
def test_distributions_declare_the_distributions_they_import(package):
    folder = DISTRIBUTIONS[package]
    declared, own = _declared(folder), _dist_name(folder)
    undeclared = set()
    for path in sorted((folder / package).rglob("*.py")):
        for module, _ in _imports(path):
            top = module.partition(".")[0]
            if top in DISTRIBUTIONS and top != package:
                if _dist_name(DISTRIBUTIONS[top]) not in declared | {own}:
                    undeclared.add(f"{path.relative_to(folder)}: {top}")
    assert sorted(undeclared) == []
    assert "lmstack" in declared, "every distribution depends on lmstack"


def test_every_public_module_and_name_exists():
    for module, names in PUBLIC_API.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert missing == [], module


def test_old_module_paths_still_import_with_a_warning():
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
    sys.modules.pop("lmstack.grammar", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import lmstack.grammar as old_grammar
    import lmstack.sample.grammar as grammar

    assert old_grammar is grammar and grammar.__spec__.name == "lmstack.sample.grammar"
    assert any("lmstack.grammar moved to lmstack.sample.grammar" in str(w.message) for w in caught)
    assert not (CORE / "grammar.py").exists()
