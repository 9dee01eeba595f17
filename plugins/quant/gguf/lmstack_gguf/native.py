"""The GGUF block kernels (csrc/gguf_matmul.cpp), built against the installed torch by
`lmstack.kernels.native` into ~/.cache/lmstack/gguf_matmul/<torch version>-<source hash>.

`python -m lmstack_gguf.native` builds them ahead of time (`make install` runs it); otherwise the
first stack using `gguf` builds them. Where they cannot be built the quantizer dequantizes each
layer once at load (what `quant.weights: none` serves) and says so in the log.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmstack.kernels.native import BuildReport, NativeExtension

ISA_NAMES = {2: "AVX-512 (F, BW, DQ, VL, VNNI)", 1: "AVX2+FMA+F16C", 0: "scalar"}
EXTENSION = NativeExtension(
    name="lmstack_gguf_ext",
    cache_name="gguf_matmul",
    sources=[Path(__file__).resolve().parent / "csrc" / name for name in ("gguf_matmul.cpp", "kquants.cpp")],
    headers=[Path(__file__).resolve().parent / "csrc" / "kquants.h"],
    report=BuildReport("lmstack-gguf", "kernels", ISA_NAMES, "`quant.weights: gguf` will dequantize at load"),
)


# The build module's interface (`lmstack.kernels.native.NativeExtension`).
load = EXTENSION.load  # the compiled extension, built on first use; ExtensionBuildError (one line) if not
load_error = EXTENSION.load_error  # why it is unavailable, or None
main = EXTENSION.report_build  # build now (`make install` runs it); exit status 0 either way

if __name__ == "__main__":
    sys.exit(main())
