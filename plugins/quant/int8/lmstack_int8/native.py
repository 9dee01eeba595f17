"""The int8 matmul's C++ kernel (csrc/int8_matmul.cpp), built against the installed torch by
`lmstack.kernels.native` into ~/.cache/lmstack/int8_matmul/<torch version>-<source hash>.

`python -m lmstack_int8.native` builds it ahead of time (`make install` runs it); otherwise the
first int8 matmul builds it. Where it cannot be built, `kernel.Int8Matmul` keeps torch's paths
(the same results, slower for fp32 activations) and `lmstack check` says why.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmstack.kernels.native import BuildReport, NativeExtension

ISA_NAMES = {3: "AVX-512 (F, BW, VL) + VNNI", 2: "AVX-512 (F, BW, VL)", 1: "AVX2+FMA", 0: "scalar"}
EXTENSION = NativeExtension(
    name="lmstack_int8_ext",
    cache_name="int8_matmul",
    sources=[Path(__file__).resolve().parent / "csrc" / "int8_matmul.cpp"],
    report=BuildReport("lmstack-int8", "kernel", ISA_NAMES, "int8 weights still work through torch's ops"),
)


# The build module's interface (`lmstack.kernels.native.NativeExtension`).
load = EXTENSION.load  # the compiled extension, built on first use; ExtensionBuildError (one line) if not
load_error = EXTENSION.load_error  # why it is unavailable, or None
main = EXTENSION.report_build  # build now (`make install` runs it); exit status 0 either way

if __name__ == "__main__":
    sys.exit(main())
