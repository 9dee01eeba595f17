"""The native CPU layer ops (core/lmstack/csrc/layer_ops.cpp) against the torch reference ops:
RMSNorm within fp32 rounding (only the summation order differs), the rotary embedding bit for
bit, SwiGLU's silu * up within a few ulps of the exact value, the AVX2 and plain builds bit for
bit; and the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from lmstack.model import layer_ops
from lmstack.model.rope import RotaryEmbedding
from lmstack.model.rope import rotate_ as rotate_reference

NATIVE = layer_ops.native()
needs_native = pytest.mark.skipif(
    NATIVE is None, reason=f"layer ops not built: {layer_ops.EXTENSION.load_error()}"
)
ISAS = [0] + ([1] if NATIVE is not None and NATIVE.best_isa() >= 1 else [])


def _rows(t: int, h: int, g: torch.Generator, pad: int) -> torch.Tensor:
    """[t, h] fp32 with a row stride of h + pad (a column slice of a wider tensor when pad > 0)."""
    return (3 * torch.randn(t, h + pad, generator=g))[:, :h]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("t", "h", "pad"), [(1, 576, 0), (3, 97, 5), (65, 5, 0), (130, 96, 3)])
def test_native_rms_norm_matches_the_reference(isa, t, h, pad):
    g = torch.Generator().manual_seed(t * 1000 + h)
    x, res, w = _rows(t, h, g, pad), _rows(t, h, g, pad), 1 + 0.1 * torch.randn(h, generator=g)
    x0, res0 = x.clone(), res.clone()
    ref = layer_ops.rms_norm_reference(x0.double(), w.double(), 1e-5)
    out = NATIVE.rms_norm(x, w, 1e-5, None, isa)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x0)  # without a residual the input is left alone
    out = NATIVE.rms_norm(x, w, 1e-5, res, isa)
    assert torch.equal(x, x0 + res0)  # the residual stream, in place
    assert torch.equal(res, res0)
    torch.testing.assert_close(
        out.double(),
        layer_ops.rms_norm_reference((x0 + res0).double(), w.double(), 1e-5),
        rtol=2e-6,
        atol=2e-6,
    )


@needs_native
def test_native_builds_agree_bit_for_bit():
    if len(ISAS) < 2:
        pytest.skip("this CPU has no AVX2+FMA: only the plain build runs")
    g = torch.Generator().manual_seed(7)
    x, w = _rows(9, 577, g, 0), torch.randn(577, generator=g)
    assert torch.equal(NATIVE.rms_norm(x, w, 1e-6, None, 0), NATIVE.rms_norm(x, w, 1e-6, None, 1))
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    cos, sin = rope.tables(torch.arange(9) * 7, torch.float32)
    a = torch.randn(9, 5, 64, generator=g)
    b = a.clone()
    NATIVE.rope_(a, cos[:, 0], sin[:, 0], 0)
    NATIVE.rope_(b, cos[:, 0], sin[:, 0], 1)
    assert torch.equal(a, b)
    gate_up = 8 * torch.randn(9, 2 * 77, generator=g)  # 77: the vector loop and its scalar tail
    assert torch.equal(NATIVE.silu_mul_(gate_up.clone(), 0), NATIVE.silu_mul_(gate_up.clone(), 1))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("t", "inter", "pad"), [(1, 1536, 0), (3, 13, 5), (70, 40, 0)])
def test_native_silu_mul_is_close_to_exact(isa, t, inter, pad):
    """In place in the gate half, within 8 fp32 ulps of the float64 value (torch's own: ~3),
    including saturated gates (silu -> 0 and -> x) and strided rows."""
    g = torch.Generator().manual_seed(t + inter)
    gate_up = (6 * torch.randn(t, 2 * inter + pad, generator=g))[:, : 2 * inter]
    gate_up[0, :4] = torch.tensor([200.0, -200.0, 0.0, -90.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    before_up = gate_up[:, inter:].clone()
    out = NATIVE.silu_mul_(gate_up, isa)
    assert out.data_ptr() == gate_up.data_ptr() and out.shape == (t, inter)
    assert torch.equal(gate_up[:, inter:], before_up)  # the up half is left alone
    # Relative, up to 1e-30 absolute where a gate below -87 saturates (the exact value is ~0).
    err = (out.double() - exact).abs() - 1e-30
    assert (err <= 8 * 2.0**-24 * exact.abs()).all(), (
        f"max error {(err / exact.abs()).max() / 2.0**-24:.1f} ulps"
    )


def test_silu_mul_takes_the_native_op_or_the_reference():
    """layer_ops.silu_mul: close to the reference for fp32 CPU rows; other dtypes are the
    reference bit for bit."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(4, 2 * 48, generator=g)
    expected = layer_ops.silu_mul_reference(gate_up.clone())
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), expected, rtol=2e-6, atol=1e-7)
    half = gate_up.to(torch.bfloat16)
    assert torch.equal(layer_ops.silu_mul(half.clone()), layer_ops.silu_mul_reference(half.clone()))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0}])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "d"), [(1, 9, 3, 64), (7, 5, 1, 18), (70, 4, 2, 32)])
def test_rotate_in_place_is_the_reference_bit_for_bit(scaling, tokens, heads, kv_heads, d):
    """Natively where built (else the reference itself): on Q and K of a fused qkv row, in place."""
    g = torch.Generator().manual_seed(tokens + d)
    rope = RotaryEmbedding(d, 4096, 10000.0, scaling)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    tables = rope.tables_full(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    qk = (heads + kv_heads) * d
    expected = qkv.clone()
    rotate_reference(expected[:, :qk].view(tokens, -1, d), *tables)
    out = layer_ops.rotate_(qkv[:, :qk].view(tokens, -1, d), *tables)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv, expected)  # V untouched, Q and K the reference's bits


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "d"), [(1, 9, 3, 64), (7, 5, 1, 18), (70, 4, 2, 32)])
def test_qkv_split_and_rotation_is_the_reference_bit_for_bit(isa, pad, tokens, heads, kv_heads, d):
    """`qkv_rope_`: Q and K rotated in place, V untouched, and q / k / v views of the fused
    output, on its own rows or a column slice of a wider tensor (`pad`); the native op with each
    build, and the torch fallback (bf16) the same views."""
    g = torch.Generator().manual_seed(tokens * d + pad)
    rope = RotaryEmbedding(d, 4096, 10000.0, None)
    tables = rope.tables_full(torch.randint(0, 4096, (tokens,), generator=g), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d + pad, generator=g)[:, pad:]
    expected = qkv.clone()
    heads_view = expected.view(tokens, -1, d)
    rotate_reference(heads_view[:, : heads + kv_heads], *tables)
    if NATIVE is not None:
        halves = (tables[0][:, 0, 0], tables[1][:, 0, 1])
        q, k, v = NATIVE.qkv_rope_(qkv, *halves, heads, kv_heads, isa)
    else:
        q, k, v = layer_ops.qkv_rope_(qkv, *tables, heads, kv_heads)
    assert torch.equal(qkv, expected)
    for got, want in zip((q, k, v), expected.view(tokens, -1, d).split((heads, kv_heads, kv_heads), 1)):
        assert got.shape == want.shape and torch.equal(got, want)
    assert q.data_ptr() == qkv.data_ptr()
    assert k.data_ptr() == qkv.data_ptr() + heads * d * 4 and v.data_ptr() == k.data_ptr() + kv_heads * d * 4
    # The wrapper off the native op's dtype (bf16): the torch ops, the same split.
    half = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)
    half_tables = rope.tables_full(torch.randint(0, 4096, (tokens,), generator=g), torch.bfloat16)
    ref = half.clone()
    rotate_reference(ref.view(tokens, -1, d)[:, : heads + kv_heads], *half_tables)
    hq, hk, hv = layer_ops.qkv_rope_(half, *half_tables, heads, kv_heads)
    assert torch.equal(half, ref)
    assert torch.equal(torch.cat((hq, hk, hv), 1), ref.view(tokens, -1, d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_take_the_reference_ops(dtype):
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(4, 40, generator=g).to(dtype), torch.randn(4, 40, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(dtype)
    expected = layer_ops.rms_norm_reference(x + res, w, 1e-5)
    assert torch.equal(layer_ops.rms_norm(x, w, 1e-5, res), expected)


def test_the_switch_turns_the_native_ops_off(monkeypatch):
    monkeypatch.setenv("LMSTACK_NATIVE_LAYER_OPS", "0")
    layer_ops.native.cache_clear()
    try:
        assert layer_ops.native() is None
    finally:
        monkeypatch.undo()
        layer_ops.native.cache_clear()
    assert (layer_ops.native() is None) == (NATIVE is None)


@needs_native
def test_bad_input_is_a_clear_error():
    with pytest.raises(RuntimeError, match="w must be"):
        NATIVE.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5, None, -1)
    with pytest.raises(RuntimeError, match="cos and sin"):
        NATIVE.rope_(torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(2, 4), -1)
    with pytest.raises(RuntimeError, match="even number of columns"):
        NATIVE.silu_mul_(torch.randn(2, 7), -1)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        NATIVE.silu_mul_(torch.randn(2, 8, dtype=torch.float64), -1)
    with pytest.raises(RuntimeError, match="are not 5 heads"):
        NATIVE.qkv_rope_(torch.randn(2, 24), torch.randn(2, 2), torch.randn(2, 2), 3, 1, -1)


@needs_native
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build `lock` file outlives a killed process; a later load must not wait on it
    forever (it once hung CI's install). A copy of the built folder under a fresh cache root, the
    stale lock added, is loaded by a new process within a deadline."""
    built = layer_ops.EXTENSION.build_dir()
    copy = tmp_path / built.relative_to(built.parents[2])
    shutil.copytree(built, copy)
    (copy / "lock").touch()
    code = "from lmstack.model import layer_ops; print(layer_ops.EXTENSION.load().best_isa())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == NATIVE.best_isa()
    assert not (copy / "lock").exists()


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_native_argmax_is_torchs(isa):
    """The greedy sampler's argmax: torch.argmax(x, dim=-1) exactly, on fresh random rows of odd
    widths (the vector loop's tail) and a row stride, with ties (the first index wins, also where
    the tie straddles the tail), -inf and +inf, NaN (torch takes the first NaN), all-equal rows."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for width in (1, 7, 8, 9, 63, 1000, 49152 + 5):
        x = _rows(6, width, g, pad=3)
        top = x.max(dim=1).values
        # Row 1: its maximum again at a later place (a tie: the first wins), and near the end.
        x[1, -1] = top[1]
        if width > 2:
            x[1, width // 2] = top[1]
        x[2].fill_(-float("inf"))
        x[3].fill_(0.5)
        if width > 3:
            x[4, width - 2] = float("nan")
            x[4, 1] = float("inf")
            x[5, 2] = float("inf")
            x[5, width - 1] = float("inf")
        want = torch.argmax(x, dim=-1)
        assert torch.equal(NATIVE.argmax_rows(x, isa), want), width
    assert torch.equal(layer_ops.argmax_rows(x), want)
    half = x.to(torch.bfloat16)
    assert torch.equal(layer_ops.argmax_rows(half), torch.argmax(half, dim=-1))  # torch's own
    with pytest.raises(RuntimeError, match="argmax over an empty row"):
        NATIVE.argmax_rows(torch.zeros(2, 0), isa)
