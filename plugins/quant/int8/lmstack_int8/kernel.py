"""int8 rows: quantizing a weight, and multiplying by it.

Format: W [N, K] ~= q [N, K] int8 * scale [N] (fp32), symmetric, q in [-127, 127], scale =
max|W[n]| / 127 rounded *up* to a bfloat16 value. A bf16-representable scale costs at most
2^-8 of the step and makes the bf16 kernel's scales exact, so every path below multiplies by
the same weight: q * scale is exact in fp32 (7 x 8 significant bits).

`int8_matmul(x [M, K], q, scale)` -> [M, N] in x's dtype picks, per call (measurements in the
README, `benchmarks/kernels/int8_cpu_matmul.py`; an AVX2 CPU, one thread):

- CPU, fp32 activations, at most `NATIVE_MAX_ROWS` rows (decode batches): this plugin's C++ kernel
  (csrc/int8_matmul.cpp), which widens int8 weights to fp32 in registers, 2-3x faster than
  the paths below at M = 1 and fp32 throughout; where it cannot be built, the paths below.
  With `int8_activations` (the quantizer's `activations: int8`) and K a multiple of 32, its
  `int8_matmul_q8` instead: x rounded to int8 per 32 values, integer dot products.
- CPU, bf16 activations: `torch.ops.aten._weight_int8pack_mm` (fp32 accumulation), 2x faster
  than the dense fp32 matmul at M = 1 and 3x faster than the dense bf16 one at M = 512.
- CPU, fp32 activations: the op's fp32 path is 5-40x slower than the dense matmul, so below
  `FP32_DEQUANT_MIN_ROWS` rows the activations go through the op in bf16 (rounded to bf16, an
  error the int8 weights' own dwarfs) and the result comes back as fp32; from that many rows,
  or with `exact_fp32`, the weight is dequantized in fp32 and multiplied densely, or, on a CPU
  with native bf16 arithmetic (not `exact_fp32`), dequantized to bf16 and multiplied in bf16
  (x rounded to bf16; 2-3.5x faster than fp32 there from 64 rows, AMD EPYC with AVX-512 BF16).
- Anything else (fp16 on the CPU: the op's fp16 path is as slow as its fp32 one; CUDA):
  dequantize in slabs of at most `SLAB_BYTES` and matmul in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmstack.kernels.hardware import native_bf16_cpu
from lmstack.kernels.scratch import reused_buffer

QMAX = 127
# fp32 activations with at most this many rows go through the C++ kernel (measured crossover with
# dequantize + fp32 matmul: between 32 and 64 rows for SmolLM2 shapes on an AVX2 CPU, README).
NATIVE_MAX_ROWS = 32
# fp32 activations with fewer rows than this run through the op in bf16 (decode batches); the
# measured crossover with dequantize + fp32 matmul lies between 8 and 32 rows for every
# SmolLM2 shape (README).
FP32_DEQUANT_MIN_ROWS = 16
# x values per int8 block with int8 activations (the C++ kernel's `int8_matmul_q8`).
INT8_ACT_BLOCK = 32
# With int8 activations, batches of at most this many rows run `int8_matmul_q8` (prefill chunks
# included): measured faster than dequantize + fp32 matmul up to here (README). On a CPU with
# native bf16 the batches above go to dequantize + bf16 matmul instead, which overtakes the
# kernel sooner: between 64 and 128 rows on a Zen 5 EPYC (README).
INT8_ACT_MAX_ROWS = 128
INT8_ACT_MAX_ROWS_NATIVE_BF16 = 64
# The largest dequantized weight slab made at once (the 49152 x 576 LM head is 113 MB in fp32).
SLAB_BYTES = 8 << 20

_OP = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
# The op's vectorized bf16 loops (x86: AVX2 8, AVX-512 16 columns a step) have no tail and use
# aligned loads of the activation and weight rows: any other width reads past the row (a
# segfault at K = 37 on an AVX2 CPU, torch 2.13). Its fp32 / fp16 paths there are scalar loops.
OP_K_MULTIPLE = 16
_ALIGN = 64


def has_int8pack_op() -> bool:
    return _OP is not None


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Positive finite fp32 values rounded up to the nearest bfloat16 value (kept in fp32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]); an all-zero row gets scale 2^-126 and q 0."""
    w = w.float()
    scale = bf16_ceil((w.abs().amax(dim=1) / QMAX).clamp(min=torch.finfo(torch.float32).tiny))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] * scale [N] in `dtype` (computed in fp32, where it is exact, then rounded once)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale)^T in x's dtype, the weight rebuilt `SLAB_BYTES` at a time."""
    n, k = q.shape
    step = min(n, max(1, SLAB_BYTES // max(1, 4 * k)))

    def weight(r: int, rows: int) -> torch.Tensor:
        w = reused_buffer(rows, k, torch.float32, x.device)
        w.copy_(q[r : r + rows]).mul_(scale[r : r + rows, None])  # exact in fp32
        return w if x.dtype == torch.float32 else w.to(x.dtype)

    if step == n:
        return F.linear(x, weight(0, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r in range(0, n, step):
        rows = min(step, n - r)
        out[:, r : r + rows] = F.linear(x, weight(r, rows))
    return out


def native_kernel():
    """The compiled C++ kernel module, or None where it cannot be built (then torch's paths)."""
    from lmstack_int8.native import EXTENSION

    return EXTENSION.module()


class Int8Matmul:
    """The matmul of one int8 weight, holding the scales in the dtypes the op wants.
    `use_native=False` keeps to torch's ops (A/B measurements)."""

    def __init__(
        self, exact_fp32: bool = False, use_native: bool = True, int8_activations: bool = False
    ) -> None:
        self.exact_fp32 = exact_fp32
        self.use_native = use_native
        self.int8_activations = int8_activations
        # The int8-activation kernel's row limit on this CPU (what takes the batches above differs).
        self._int8_max_rows = INT8_ACT_MAX_ROWS_NATIVE_BF16 if native_bf16_cpu() else INT8_ACT_MAX_ROWS
        self._scales: dict[torch.dtype, torch.Tensor] = {}

    def reset(self) -> None:
        self._scales.clear()

    def scales_as(self, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s = self._scales.get(dtype)
        if s is None:
            s = self._scales[dtype] = scale.to(dtype)
        return s

    def native_fn(self, ext, k: int):
        """The C++ kernel's function for a weight of k columns: the int8-activation one where
        asked for and k is whole 32-blocks, else the fp32 one."""
        return ext.int8_matmul_q8 if self.rounds_activations(k) else ext.int8_matmul

    def rounds_activations(self, k: int) -> bool:
        return self.int8_activations and k % INT8_ACT_BLOCK == 0

    def native_max_rows(self, k: int) -> int:
        """The most rows the C++ kernel takes for a weight of k columns."""
        return self._int8_max_rows if self.rounds_activations(k) else NATIVE_MAX_ROWS

    def path(self, x: torch.Tensor, q: torch.Tensor) -> str:
        """Which computation x gets: "native" (the C++ kernel, fp32), "op" (the int8 op in x's
        dtype), "op-bf16" (the op in bf16, fp32 in and out), "dequant-bf16" (fp32 in and out,
        the weight dequantized to bf16 and x rounded to it: on CPUs with native bf16 arithmetic,
        where it multiplies 2-3.5x faster than fp32) or "dequant"."""
        if x.device.type != "cpu":
            return "dequant"
        if (
            self.use_native
            and x.dtype == torch.float32
            and x.shape[0] <= self.native_max_rows(q.shape[1])
            and native_kernel() is not None
        ):
            return "native"
        if _OP is None or not op_fits(q):
            return "dequant"
        if x.dtype == torch.bfloat16:
            return "op"
        if x.dtype == torch.float32 and not self.exact_fp32 and x.shape[0] < FP32_DEQUANT_MIN_ROWS:
            return "op-bf16"
        if x.dtype == torch.float32 and not self.exact_fp32 and native_bf16_cpu():
            return "dequant-bf16"
        return "dequant"

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        path = self.path(x, q)
        if path == "dequant-bf16":
            return dequant_matmul(x.to(torch.bfloat16), q, scale).float()
        if path == "native":
            ext = native_kernel()
            return self.native_fn(ext, q.shape[1])(x if x.stride(-1) == 1 else x.contiguous(), q, scale)
        if path == "op":
            return _OP(aligned(x), q, self.scales_as(scale, x.dtype))
        if path == "op-bf16":
            bf16 = torch.bfloat16
            return _OP(aligned(x.to(bf16)), q, self.scales_as(scale, bf16)).float()
        return dequant_matmul(x, q, scale)


def op_fits(q: torch.Tensor) -> bool:
    """Whether the op's bf16 loops can take this weight (whole steps, aligned rows)."""
    return q.shape[1] % OP_K_MULTIPLE == 0 and q.is_contiguous() and q.data_ptr() % _ALIGN == 0


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous, starting on an `_ALIGN`-byte boundary (a row slice of a batch may not)."""
    x = x.contiguous()
    return x if x.data_ptr() % _ALIGN == 0 else x.clone()
