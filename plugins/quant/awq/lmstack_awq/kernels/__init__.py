"""int4 matmul kernels for `Int4Linear`, chosen per layer on its first call.

- CUDA: the Triton W4A16 dequant-GEMM (`triton_w4a16`) on the nibble layout as loaded.
- CPU, fp32 activations, lmstack-gguf's kernels built, groups of whole 32-column blocks (and not
  `fp32_activations: exact`): the layer as GGUF Q4_1 blocks through those kernels
  (`gguf_blocks`, in place of the nibble buffer).
- CPU otherwise: `torch.ops.aten._weight_int4pack_mm_for_cpu` where the shape allows
  (`cpu_int4pack`: it re-lays the weight out once, in place of the nibble buffer); anything
  else: `reference` (dequantize, then matmul).

A kernel is an object with `__call__(layer, x [M, in]) -> [M, out]` in x's dtype and
`codes(layer) -> uint8 [out, in]` (the codes back from whatever layout it keeps); optionally
`direct(layer) -> ((op, args), (op, args), max_rows)`: what `Int4Linear` calls as
`op(x, *args)`, the pair picked by `layer.int8_activations`, on fp32 rows [M <= max_rows, in] in
place of `__call__` (the same result).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lmstack_awq.linear import Int4Linear


class Int4Kernel(Protocol):
    def __call__(self, layer: Int4Linear, x: torch.Tensor) -> torch.Tensor: ...

    def codes(self, layer: Int4Linear) -> torch.Tensor: ...


def unpack_codes(packed: torch.Tensor, cols: int) -> torch.Tensor:
    from lmstack_awq.int4_math import unpack_nibbles

    return unpack_nibbles(packed, cols)


def select(layer: Int4Linear, x: torch.Tensor) -> Int4Kernel:
    from lmstack_awq.kernels.reference import ReferenceKernel

    interpret = getattr(layer, "interpret_triton", False)
    if x.device.type == "cuda" or interpret:
        from lmstack_awq.kernels.triton_w4a16 import TritonW4A16

        return TritonW4A16(interpret=interpret)
    if x.device.type == "cpu":
        from lmstack_awq.kernels.cpu_int4pack import CpuInt4Pack
        from lmstack_awq.kernels.gguf_blocks import GGUFBlocks

        if x.dtype == torch.float32 and not layer.exact_fp32 and GGUFBlocks.supports(layer):
            return GGUFBlocks(layer)

        if CpuInt4Pack.supports(layer):
            return CpuInt4Pack(layer)
    return ReferenceKernel()
