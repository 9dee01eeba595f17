"""Building a plugin's C++ extension against the torch that is installed.

pip's build isolation would compile against whatever torch it downloads, not the one installed,
so a plugin's kernels are not built by pip: `NativeExtension.load()` compiles them with
`torch.utils.cpp_extension.load` into a per-user cache directory keyed by the torch version and a
hash of the sources and flags (a new torch or an edited kernel builds afresh; an unchanged one
loads in milliseconds). A plugin's `python -m <its build module>` builds ahead of time (`make
install` runs it); otherwise the first use builds it. A machine without a C++ compiler, OpenMP or
ninja gets `ExtensionBuildError` with a one-line reason, and the rest of lmstack is unaffected.

torch guards a build folder with a plain `lock` file that a killed process leaves behind, and
every later load of that folder then waits on it forever (a test run stopped mid-load once hung
CI's `make install` for its whole 90 minutes). So each load here first takes an flock on a file
beside the folder, which the kernel drops when its holder dies: whoever holds it is the only
lmstack process in the folder, and a `lock` file found then is stale and removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

DEFAULT_FLAGS = ("-O3", "-fopenmp", "-std=c++17")
# lmstack's own headers, on every extension's include path: `#include "isa_cap.h"` (the
# LMSTACK_MAX_ISA cap each extension's run-time ISA choice applies).
SHARED_INCLUDE = Path(__file__).resolve().parent.parent / "csrc"
SHARED_HEADERS = (SHARED_INCLUDE / "isa_cap.h",)


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive flock on `path` (created if missing) for the block; released by the
    kernel even if this process is killed. Without fcntl (not POSIX) it holds nothing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ExtensionBuildError(RuntimeError):
    """The extension could not be built or loaded; the message is one line saying why."""


@dataclass(frozen=True)
class BuildReport:
    """How `python -m <build module>` reports a build: `title` names the distribution, `what`
    the extension; `isa_names` names the extension's `best_isa()` levels; `without`: what still
    works when the build failed."""

    title: str
    what: str
    isa_names: Mapping[int, str]
    without: str


class NativeExtension:
    """One C++ extension: `sources` are compiled, `headers` only hashed (an edit rebuilds), and
    lmstack's shared headers (`SHARED_HEADERS`) are on its include path and in its hash.

    A plugin's build module holds one, and needs nothing else: ``load = EXTENSION.load``,
    ``load_error = EXTENSION.load_error`` and ``main = EXTENSION.report_build`` (with `report`
    set) are its whole interface."""

    def __init__(
        self,
        name: str,
        cache_name: str,
        sources: Sequence[Path],
        headers: Sequence[Path] = (),
        flags: Sequence[str] = DEFAULT_FLAGS,
        report: BuildReport | None = None,
    ) -> None:
        self.report = report
        self.name = name  # the Python module name of the built extension
        self.cache_name = cache_name  # its folder under ~/.cache/lmstack
        self.sources = tuple(Path(p) for p in sources)
        self.headers = tuple(Path(p) for p in headers)
        self.flags = tuple(flags)
        self._load_cached = functools.cache(self._try_compile)

    def source_hash(self) -> str:
        h = hashlib.sha256()
        for path in (*self.sources, *self.headers, *SHARED_HEADERS):
            # The path too: torch's build records where the sources are, so two checkouts (or a
            # checkout and an installed wheel) sharing one folder would rebuild it for each other,
            # each holding the build lock while the other waits.
            h.update(str(path.resolve()).encode())
            h.update(path.read_bytes())
        h.update(" ".join(self.flags).encode())
        return h.hexdigest()[:12]

    def build_dir(self) -> Path:
        """~/.cache/lmstack/<cache_name>/<torch version>-<source hash> (XDG_CACHE_HOME honoured)."""
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return root / "lmstack" / self.cache_name / f"{torch.__version__}-{self.source_hash()}"

    def _compile(self) -> ModuleType:
        from torch.utils import cpp_extension

        compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
        if shutil.which(compiler) is None:
            raise ExtensionBuildError(
                f"no C++ compiler found ({compiler!r} is not on PATH; install g++ or set CXX)"
            )
        try:  # pip's ninja lives in the venv's bin, which is not on PATH unless the venv is active
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            raise ExtensionBuildError("ninja is not installed (pip install ninja)") from None
        folder = self.build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with _exclusive(folder.with_name(folder.name + ".flock")):
                (folder / "lock").unlink(missing_ok=True)  # stale: see the module's docstring
                return cpp_extension.load(
                    name=self.name,
                    sources=[str(p) for p in self.sources],
                    extra_cflags=list(self.flags),
                    extra_include_paths=[str(SHARED_INCLUDE)],
                    extra_ldflags=["-fopenmp"] if "-fopenmp" in self.flags else [],
                    build_directory=str(folder),
                    verbose=False,
                )
        except Exception as e:  # compiler errors arrive as RuntimeError / CalledProcessError
            lines = str(e).splitlines() or [type(e).__name__]
            first = next((line for line in lines if "error" in line.lower()), lines[0])
            raise ExtensionBuildError(
                f"compiling the C++ extension in {folder} failed: {first.strip()}"
            ) from e

    def _try_compile(self) -> ModuleType | ExtensionBuildError:
        try:
            return self._compile()
        except ExtensionBuildError as e:
            log.warning("%s is unavailable: %s", self.name, e)
            return e  # remembered: a failed build is not retried on every layer or resolution

    def load(self) -> ModuleType:
        """The compiled extension, built on first use; raises `ExtensionBuildError` (one line) if it cannot be."""
        result = self._load_cached()
        if isinstance(result, ExtensionBuildError):
            raise result
        return result

    def load_error(self) -> str | None:
        """Why the extension is unavailable, or None when it loads."""
        try:
            self.load()
        except ExtensionBuildError as e:
            return str(e)
        return None

    def module(self) -> ModuleType | None:
        """The compiled extension, or None where it cannot be built; cheap after the first call
        (the outcome is cached), so a per-call kernel choice may ask."""
        result = self._load_cached()
        return None if isinstance(result, ExtensionBuildError) else result

    def report_build(self, report: BuildReport | None = None) -> int:
        """Build now and say what came of it: a plugin's `python -m <build module>`, which `make
        install` runs. Exit status 0 either way (`report.without`: what still works if it failed)."""
        report = report or self.report
        if report is None:
            raise ValueError(f"{self.name}: no BuildReport to report the build with")
        title, what, isa_names, without = report.title, report.what, report.isa_names, report.without
        print(f"{title}: building the {what} against torch {torch.__version__} ...", flush=True)
        problem = self.load_error()
        if problem is None:
            isa = isa_names[self.load().best_isa()]
            print(f"{title}: ready ({self.build_dir()}, kernels for this CPU: {isa})")
        else:
            print(f"{title}: {what} NOT built ({problem}); {without}", file=sys.stderr)
        return 0
