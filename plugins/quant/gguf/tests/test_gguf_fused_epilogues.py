"""The panel kernel's fused epilogues (csrc/gguf_matmul.cpp, AVX-512 VNNI): a SwiGLU gate_up
layer's silu(gate) * up straight from its panels (`gguf_matmul_panels_swiglu`), the gate and up
products combined as the tiles store them, equals `gguf_matmul_panels` put through
`layer_ops.silu_mul` bit for bit; a product added into a residual stream as the tiles store it
(`gguf_matmul_panels_add_`) equals `gguf_matmul_panels` then `add_`; both for every panel kind and
the batch sizes of each tile path (one panel at a time, widened pairs, pair tiles); a call they
cannot take fails in one line; `GGUFLinear.fast_swiglu_op` / `fast_add_op` offer them only where
they apply. Random blocks with a fresh seed each run (printed on failure)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf_q5_panels import random_blocks  # every panel kind, Q5_K too

from lmstack.interfaces import LinearSpec
from lmstack.model.layer_ops import silu_mul
from lmstack_gguf import native
from lmstack_gguf.linear import GGUFLinear

ext = None if native.load_error() else native.load()
pytestmark = pytest.mark.skipif(ext is None, reason="the kernels did not build")
avx512 = pytest.mark.skipif(ext is None or ext.best_isa() < 2, reason="the fused kernel needs AVX-512 VNNI")

# (kind, K): every panel kind; the K-quants at their 256-value super-blocks.
KINDS = [
    (T.Q4_0, 64),
    (T.Q4_1, 96),
    (T.Q5_0, 96),
    (T.Q5_1, 64),
    (T.Q8_0, 160),
    (T.Q4_K, 256),
    (T.Q5_K, 256),
    (T.Q6_K, 512),
]
# One panel at a time (up to 63 rows, Q6_K 31), widened pairs (the 5- and 6-bit kinds from 64
# rows, Q6_K from 32), pair tiles (the others from 64), with rests of every tile size.
ROWS = (1, 7, 31, 32, 33, 64, 101)


by_kind = pytest.mark.parametrize("kind,k", KINDS, ids=lambda v: getattr(v, "name", str(v)))


def fresh_panels(kind: T, k: int, n: int) -> tuple[int, np.random.Generator, torch.Tensor]:
    """A fresh seed, its generator, and n random rows of `kind` packed in panels."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    return seed, rng, ext.gguf_pack_panels(torch.from_numpy(random_blocks(kind, n, k, rng)), int(kind), k)


@avx512
@by_kind
@pytest.mark.parametrize("half", [16, 48])
def test_fused_gate_up_is_the_products_put_through_silu_mul(kind, k, half):
    seed, rng, packed = fresh_panels(kind, k, 2 * half)
    for m in ROWS:
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) * 3
        want = silu_mul(ext.gguf_matmul_panels(x, packed, int(kind), 2 * half))
        got = ext.gguf_matmul_panels_swiglu(x, packed, int(kind), 2 * half)
        assert got.shape == (m, half) and got.is_contiguous()
        assert torch.equal(got, want), f"seed {seed}, {kind.name}, {m} rows, {half} per half"


@avx512
@by_kind
@pytest.mark.parametrize("n", [16, 40])
def test_products_added_in_place_are_the_products_then_add_(kind, k, n):
    seed, rng, packed = fresh_panels(kind, k, n)
    for m in ROWS:
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        residual = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)) * 4
        want = ext.gguf_matmul_panels(x, packed, int(kind), n).add_(residual)
        out = residual.clone()
        got = ext.gguf_matmul_panels_add_(x, packed, int(kind), n, out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, want), f"seed {seed}, {kind.name}, {m} rows, {n} outputs"


@avx512
def test_a_layer_the_fused_kernel_cannot_take_is_one_line():
    rng = np.random.default_rng(0)
    packed = ext.gguf_pack_panels(torch.from_numpy(random_blocks(T.Q8_0, 48, 64, rng)), int(T.Q8_0), 64)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="two halves of a multiple of 16 rows each, got 1 weight"):
        ext.gguf_matmul_panels_swiglu(x, packed, int(T.Q8_0), 48)  # halves of 24 rows
    with pytest.raises(RuntimeError, match="gguf_matmul_panels_swiglu needs AVX-512 VNNI"):
        ext.gguf_matmul_panels_swiglu(x, packed[:2].contiguous(), int(T.Q8_0), 32, 1)  # AVX2
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU float32 tensor \[3, 48\]"):
        ext.gguf_matmul_panels_add_(x, packed, int(T.Q8_0), 48, torch.zeros(3, 47))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU float32 tensor \[3, 48\]"):
        ext.gguf_matmul_panels_add_(x, packed, int(T.Q8_0), 48, torch.zeros(48, 3).t())


def _gate_up(half: int, k: int, kind: T) -> GGUFLinear:
    """A gate_up layer (`prefill: panels`) of random gate and up parts, finalized as the loader does."""
    spec = LinearSpec(k, 2 * half, False, "gate_up_proj", output_sizes=(half, half))
    layer = GGUFLinear(spec, int8_activations=True, kernel_max_rows=0, panels=True)
    rng = np.random.default_rng(1)
    layer._parts = {i: (int(kind), torch.from_numpy(random_blocks(kind, half, k, rng))) for i in range(2)}
    layer.finalize()
    return layer


@pytest.mark.skipif(ext is None or ext.best_isa() < 1, reason="the panel kernel needs AVX2")
def test_gguf_linear_offers_the_fused_ops_only_where_they_apply():
    layer = _gate_up(32, 96, T.Q5_0)
    x = torch.randn(5, 96)
    fused, adds = layer.fast_swiglu_op(), layer.fast_add_op()
    if ext.best_isa() < 2:
        assert fused is None and adds is None  # AVX2: the separate calls
        return
    op, most = fused
    assert most == layer.fast_op()[1]
    assert torch.equal(op(x), silu_mul(layer(x)))
    assert _gate_up(24, 96, T.Q5_0).fast_swiglu_op() is None  # halves not a multiple of 16
    add, most = adds
    assert most == layer.fast_op()[1]
    residual = torch.randn(5, 64)
    want = layer(x).add_(residual)
    assert torch.equal(add(x, residual), want) and torch.equal(residual, want)
