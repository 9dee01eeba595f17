"""Building and loading the C++ extension.

pip's build isolation would compile against whatever torch it downloads, not the one installed,
so the extension is not built by pip: `torch.utils.cpp_extension.load` compiles it against the
running torch into a per-user cache directory keyed by the torch version and a hash of the
sources (a new torch or an edited kernel builds afresh; an unchanged one loads in milliseconds).

`python -m lmstack_cpu_paged.build` builds it ahead of time (`make install` runs it); otherwise
the first stack that uses `cpu-paged` builds it. A machine without a C++ compiler, OpenMP or
ninja gets `BuildError` with a one-line reason, and the rest of lmstack is unaffected.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCES = Path(__file__).resolve().parent / "csrc"
CPP = SOURCES / "cpu_paged.cpp"
HEADERS = (SOURCES / "attention_impl.h",)
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message is one line saying why."""


def source_hash() -> str:
    h = hashlib.sha256()
    for path in (CPP, *HEADERS):
        h.update(path.read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """~/.cache/lmstack/cpu_paged/<torch version>-<source hash> (XDG_CACHE_HOME honoured)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "lmstack" / "cpu_paged" / f"{torch.__version__}-{source_hash()}"


def _compile() -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler found ({compiler!r} is not on PATH; install g++ or set CXX)")
    try:  # pip's ninja lives in the venv's bin, which is not on PATH unless the venv is activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise BuildError("ninja is not installed (pip install ninja)") from None
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="lmstack_cpu_paged_ext",
            sources=[str(CPP)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # compiler errors arrive as RuntimeError / CalledProcessError
        first = next(
            (line for line in str(e).splitlines() if "error" in line.lower()), str(e).splitlines()[0]
        )
        raise BuildError(f"compiling the C++ extension in {folder} failed: {first.strip()}") from e


@functools.cache
def _load_cached() -> ModuleType | BuildError:
    try:
        return _compile()
    except BuildError as e:
        return e  # remembered: a failed build is not retried on every layer or resolution


def load() -> ModuleType:
    """The compiled extension, built on first use; raises `BuildError` (one line) if it cannot be."""
    result = _load_cached()
    if isinstance(result, BuildError):
        raise result
    return result


def load_error() -> str | None:
    """Why the extension is unavailable, or None when it loads."""
    try:
        load()
    except BuildError as e:
        return str(e)
    return None


def main() -> int:
    """Build now (run by `make install`). Exit status 0 either way: a machine that cannot build
    keeps every other backend, so this only says what happened."""
    print(
        f"lmstack cpu-paged: building the attention extension against torch {torch.__version__} ...",
        flush=True,
    )
    problem = load_error()
    if problem is None:
        isa = {2: "AVX-512", 1: "AVX2+FMA", 0: "scalar"}[load().best_isa()]
        print(f"lmstack cpu-paged: ready ({build_dir()}, kernels for this CPU: {isa})")
    else:
        print(
            f"lmstack cpu-paged: NOT built ({problem}); stacks naming attention cpu-paged will be "
            "refused, the torch backend still works",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
