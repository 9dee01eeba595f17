"""The GGUF block kernels (csrc/gguf_matmul.cpp), built against the installed torch by
`lmstack.kernels.native` into ~/.cache/lmstack/gguf_matmul/<torch version>-<source hash>.

`python -m lmstack_gguf.native` builds them ahead of time (`make install` runs it); otherwise the
first stack using `gguf` builds them. Where they cannot be built the quantizer dequantizes each
layer once at load (what `quant.weights: none` serves) and says so in the log.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from lmstack.kernels.native import NativeExtension

EXTENSION = NativeExtension(
    name="lmstack_gguf_ext",
    cache_name="gguf_matmul",
    sources=[Path(__file__).resolve().parent / "csrc" / "gguf_matmul.cpp"],
)
ISA_NAMES = {2: "AVX-512 (F, BW, DQ, VL, VNNI)", 1: "AVX2+FMA+F16C", 0: "scalar"}


def load() -> ModuleType:
    """The compiled kernels, built on first use; raises `ExtensionBuildError` (one line) if they cannot be."""
    return EXTENSION.load()


def load_error() -> str | None:
    """Why the kernels are unavailable, or None when they load."""
    return EXTENSION.load_error()


def main() -> int:
    """Build now (run by `make install`); without the kernels the quantizer dequantizes at load."""
    return EXTENSION.report_build(
        "lmstack-gguf", "kernels", ISA_NAMES, "`quant.weights: gguf` will dequantize at load"
    )


if __name__ == "__main__":
    sys.exit(main())
