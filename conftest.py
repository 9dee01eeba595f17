"""Repository-wide test setup (every test directory in `testpaths` sits below this file).

The Triton kernels of the attention plugins are tested in the Triton interpreter on the CPU.
Triton fixes interpreter or compiled mode for the whole process when it is first imported, and
`transformers` and torch's model code import it; so the mode is chosen here, before any test
module loads. A variable set by the caller wins.

The interpreter runs each kernel as small NumPy calls between torch ops. NumPy's OpenBLAS
threads keep spinning after each call and starve torch's threads on a small machine (measured
here: one [32, 64] x [64, 256] tile product took ~3 ms instead of ~10 us), so NumPy gets one.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
