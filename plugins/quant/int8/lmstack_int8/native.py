"""The int8 matmul's C++ kernel (csrc/int8_matmul.cpp), built against the installed torch by
`lmstack.kernels.native` into ~/.cache/lmstack/int8_matmul/<torch version>-<source hash>.

`python -m lmstack_int8.native` builds it ahead of time (`make install` runs it); otherwise the
first int8 matmul builds it. Where it cannot be built, `kernel.Int8Matmul` keeps torch's paths
(the same results, slower for fp32 activations) and `lmstack check` says why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from lmstack.kernels.native import NativeExtension

EXTENSION = NativeExtension(
    name="lmstack_int8_ext",
    cache_name="int8_matmul",
    sources=[Path(__file__).resolve().parent / "csrc" / "int8_matmul.cpp"],
)
ISA_NAMES = {3: "AVX-512 (F, BW, VL) + VNNI", 2: "AVX-512 (F, BW, VL)", 1: "AVX2+FMA", 0: "scalar"}


def load() -> ModuleType:
    """The compiled kernel, built on first use; raises `ExtensionBuildError` (one line) if it cannot be."""
    return EXTENSION.load()


def load_error() -> str | None:
    """Why the kernel is unavailable, or None when it loads."""
    return EXTENSION.load_error()


def main() -> int:
    """Build now (run by `make install`); without the kernel the int8 quantizer still works."""
    return EXTENSION.report_build(
        "lmstack-int8", "kernel", ISA_NAMES, "int8 weights still work through torch's ops"
    )


if __name__ == "__main__":
    sys.exit(main())
