"""lmstack-gguf's public surface: what another distribution may import from it (lmstack-awq
multiplies its int4 groups as Q4_1G blocks through these kernels). Everything else in
`lmstack_gguf` is internal; a change to a name here is a change of lmstack-gguf's major version.

- `native_kernel()`: the compiled C++ extension, or None where it did not build. Its ops take
  fp32 activations and uint8 block rows: `gguf_matmul(x, blocks, type)`, `gguf_matmul_q8` (x
  rounded to int8 per 32 values first), `gguf_pack_panels(blocks, type, k)` with
  `gguf_matmul_panels(x, panels, type, n)` and `gguf_panel_blocks(panels, type, k, ids)`.
- Block layouts: `Q4_1G` (Q4_1 blocks with one (d, m) header per group), `grouped_type(group)`
  (the Q4_1G type of a group size, or None), `group_q4_1(blocks, k, type)` (Q4_1 rows to it).
- `dequantize_blocks(blocks, type, k, into=None)`, `dequant_matmul(x, blocks, type, k)` (the
  weight rebuilt a slab at a time).
- Batch-size crossovers measured on this project's CPUs: `NATIVE_MAX_ROWS` (the block
  kernel's largest batch), `BF16_COPY_MIN_ROWS` (where a bf16 multiply overtakes it on a
  native-bf16 CPU), `layer_panels_min_rows()` and `panels_cpu()` (whether the panel kernel runs).
"""

from lmstack_gguf.kernel import (
    NATIVE_MAX_ROWS,
    Q4_1G,
    dequant_matmul,
    dequantize_blocks,
    group_q4_1,
    grouped_type,
    native_kernel,
)
from lmstack_gguf.quantizer import BF16_COPY_MIN_ROWS, layer_panels_min_rows, panels_cpu

__all__ = [
    "BF16_COPY_MIN_ROWS",
    "NATIVE_MAX_ROWS",
    "Q4_1G",
    "dequant_matmul",
    "dequantize_blocks",
    "group_q4_1",
    "grouped_type",
    "layer_panels_min_rows",
    "native_kernel",
    "panels_cpu",
]
