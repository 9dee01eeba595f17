"""Building and loading the C++ extension (`lmstack.kernels.native`: compiled against the installed
torch into ~/.cache/lmstack/cpu_paged/<torch version>-<source hash>).

`python -m lmstack_cpu_paged.build` builds it ahead of time (`make install` runs it); otherwise
the first stack that uses `cpu-paged` builds it. A machine without a C++ compiler, OpenMP or
ninja gets `BuildError` with a one-line reason, and the rest of lmstack is unaffected.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmstack.kernels.native import BuildReport, NativeExtension
from lmstack.kernels.native import ExtensionBuildError as BuildError

__all__ = ["BuildError", "EXTENSION", "load", "load_error", "main"]

SOURCES = Path(__file__).resolve().parent / "csrc"
EXTENSION = NativeExtension(
    name="lmstack_cpu_paged_ext",
    cache_name="cpu_paged",
    sources=[SOURCES / "cpu_paged.cpp"],
    headers=[SOURCES / "attention_impl.h"],
    report=BuildReport(
        "lmstack cpu-paged",
        "attention extension",
        {2: "AVX-512", 1: "AVX2+FMA", 0: "scalar"},
        "stacks naming attention cpu-paged will be refused, the torch backend still works",
    ),
)


# The build module's interface (`lmstack.kernels.native.NativeExtension`).
load = EXTENSION.load  # the compiled extension, built on first use; ExtensionBuildError (one line) if not
load_error = EXTENSION.load_error  # why it is unavailable, or None
main = EXTENSION.report_build  # build now (`make install` runs it); exit status 0 either way

if __name__ == "__main__":
    sys.exit(main())
