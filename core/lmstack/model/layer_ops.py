"""The decoder layer's small ops, each one native call on a CPU: RMSNorm (with its residual add),
the rotary embedding in place (with the q / k / v split of the fused projection) and SwiGLU's
silu(gate) * up in place (csrc/layer_ops.cpp); GeGLU's gelu_tanh(gate) * up as torch ops.

Why: a decode step at batch 1 is ~10 torch ops of glue per layer around the matmuls; each costs
its dispatch (5-30 us on a CPU) whatever its size, and a 576-wide RMSNorm as five ops took ~70 us
for ~1 us of arithmetic. The native ops take fp32 CPU tensors; anything else (bf16, a GPU, no
C++ compiler on the machine) runs the torch reference ops, which define the semantics: the
native rotary embedding gives the same bits, the native RMSNorm differs only in the summation
order of its mean of squares.

The extension is built against the installed torch by `lmstack.kernels.native` (`make install` runs
`python -m lmstack.model.layer_ops`; otherwise the first fp32 CPU forward builds it).
`LMSTACK_NATIVE_LAYER_OPS=0` turns it off (A/B measurements).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from lmstack.kernels.native import BuildReport, NativeExtension
from lmstack.model.rope import rotate_ as rotate_reference

EXTENSION = NativeExtension(
    name="lmstack_layer_ops",
    cache_name="layer_ops",
    sources=[Path(__file__).resolve().parent.parent / "csrc" / "layer_ops.cpp"],
    # No fused multiply-add: the AVX2 and plain builds, and the rotary embedding and torch's,
    # then give the same bits.
    flags=("-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"),
)
ISA_NAMES = {1: "AVX2+FMA", 0: "scalar"}


@functools.cache
def native() -> ModuleType | None:
    """The compiled ops, or None where they are turned off or cannot be built (logged once)."""
    if os.environ.get("LMSTACK_NATIVE_LAYER_OPS", "1") == "0":
        return None
    return EXTENSION.module()


def _takes(x: torch.Tensor) -> bool:
    # `is_cpu` rather than `device.type`: this runs ~240 times a decode step, and building the
    # device object cost ~0.5 us of the 0.7 (Zen 3).
    return x.dtype is torch.float32 and x.is_cpu and not x.requires_grad


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32 and cast back before the weight, as the Hugging Face reference does; in
    place on the fp32 temporary (an fp32 stream skips the no-op casts)."""
    xf = x if x.dtype == torch.float32 else x.float()
    xf = xf * xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (xf if x.dtype == torch.float32 else xf.to(x.dtype)).mul_(weight)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., H]; with `residual`, x += residual first, in place (x must be a tensor
    the caller owns)."""
    # The tensor checks first: a GPU or bf16 stack never builds the CPU extension.
    if (
        _takes(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and _takes(weight)
        and (residual is None or (_takes(residual) and residual.stride(-1) == 1))
        and (ops := native()) is not None
    ):
        return ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x.add_(residual)
    return rms_norm_reference(x, weight, eps)


# The half tables the native rotation reads, of the step's latest full tables: every layer of a
# step passes the same two tensors, so the slicing (two indexing ops, ~5 us) happens once.
_halves: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _half_tables(
    cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    global _halves
    last = _halves  # one read: another thread may replace it meanwhile
    if last is None or last[0] is not cos or last[1] is not sin:
        last = _halves = (cos, sin, cos[:, 0, 0], sin[:, 0, 1])
    return last


def half_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The half tables the native `rope_` / `qkv_rope_` read, of full tables from
    `RotaryEmbedding.tables_full` (sliced once per step)."""
    halves = _half_tables(cos, sin)
    return halves[2], halves[3]


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`lmstack.model.rope.rotate_`, natively where it can: x [T, H, D], tables from
    `RotaryEmbedding.tables_full` ([T, 1, 2, D/2]: (cos, cos) and (-sin, sin))."""
    if _takes(x) and _takes(cos) and x.stride(-1) == 1 and (ops := native()) is not None:
        halves = _half_tables(cos, sin)
        return ops.rope_(x, halves[2], halves[3])
    return rotate_reference(x, cos, sin)


def qkv_rope_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output qkv [T, (Hq + 2 Hkv) D] split into q [T, Hq, D],
    k [T, Hkv, D] and v [T, Hkv, D] (views of it), the query and key heads rotated in place
    (`rotate_`). One native call on a CPU in fp32: the four slices, four views and the rotation
    cost ~22 us a layer from Python (Zen 3)."""
    if (
        _takes(qkv)
        and qkv.dim() == 2
        and qkv.stride(-1) == 1
        and _takes(cos)
        and (ops := native()) is not None
    ):
        halves = _half_tables(cos, sin)
        return ops.qkv_rope_(qkv, halves[2], halves[3], num_heads, num_kv_heads)
    t = qkv.shape[0]
    heads = qkv.view(t, num_heads + 2 * num_kv_heads, -1)
    rotate_(heads[:, : num_heads + num_kv_heads], cos, sin)
    return (
        heads[:, :num_heads],
        heads[:, num_heads : num_heads + num_kv_heads],
        heads[:, num_heads + num_kv_heads :],
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up from the fused [T, 2I] gate/up output, in place in its gate half
    (which it returns). Natively for fp32 CPU rows (within a few ulps of the torch ops, the same
    on every build); otherwise two torch kernels, no allocation."""
    if _takes(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1 and (ops := native()) is not None:
        return ops.silu_mul_(gate_up)
    return silu_mul_reference(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.requires_grad:  # autograd cannot follow an in-place op on a chunk (scale tuning)
        return F.silu(gate) * up
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`) from the fused [T, 2I]
    gate/up output: torch's kernels (a fresh [T, I] tensor; no native op yet)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.requires_grad:  # autograd cannot follow an in-place op on a chunk (scale tuning)
        return F.gelu(gate, approximate="tanh") * up
    return F.gelu(gate, approximate="tanh").mul_(up)


# config.json `hidden_act` -> the gated feed-forward activation on the fused gate/up output.
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [T, V] (the first of equal maxima; the first NaN where
    there is one): natively for fp32 CPU rows, one vectorised pass where torch's CPU argmax is a
    scalar loop (~50 us a 49,152-wide row on Zen 3); torch's elsewhere."""
    if (
        _takes(logits)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
        and (ops := native()) is not None
    ):
        return ops.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def main() -> int:
    """Build now (run by `make install`); without it the torch ops run."""
    return EXTENSION.report_build(
        BuildReport("lmstack", "layer ops", ISA_NAMES, "the torch reference ops will run")
    )


if __name__ == "__main__":
    sys.exit(main())
