"""`gguf_matmul_panel_segments` (csrc/gguf_matmul.cpp): a fused layer's segments of different
types, each in 16-row panels, multiplied in one call (x rounded to int8 once, one parallel region)
give bit for bit the columns of `gguf_matmul_panels` per segment joined, on each panel ISA the CPU
has; bad lists fail in one line naming the segment; `GGUFLinear` binds its decode path to the op
when every segment is in panels, and its output is the per-segment path's. Random blocks with a
fresh seed each run (printed on failure)."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from lmstack.interfaces import LinearSpec
from lmstack_gguf import linear, native
from lmstack_gguf.kernel import panel_types
from lmstack_gguf.linear import GGUFLinear

ext = None if native.load_error() else native.load()
pytestmark = pytest.mark.skipif(
    ext is None or ext.best_isa() < 1, reason="the panel kernel needs AVX2 and the built kernels"
)

# Where a block keeps its fp16 scales (the other bytes are any codes).
FP16_AT = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q6_K: (208,),
}
PANEL_ISAS = [1, 2]
# (types, rows, K): SmolLM2's Q4_K_M qkv (Q5_0 q / k, Q8_0 v), Q4_K_M's (Q4_K, Q6_K v), three
# legacy and 5-bit types; partly filled and lone last panels (odd pair counts on AVX-512).
MIXES = [
    ((T.Q5_0, T.Q8_0), (40, 24), 96),
    ((T.Q4_K, T.Q6_K), (17, 40), 512),
    ((T.Q4_1, T.Q5_1, T.Q8_0), (40, 24, 8), 160),
    ((T.Q6_K, T.Q4_0, T.Q5_0), (17, 1, 33), 256),
]


def random_blocks(typ: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, row bytes]: random codes and scales, finite fp16 d (and m / dmin), some zero."""
    values, size = GGML_QUANT_SIZES[typ]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in FP16_AT[typ]:
        d = (rng.standard_normal((n, k // values)) * 0.01).astype(np.float16)
        d[rng.random(d.shape) < 0.05] = 0.0
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def skip_missing(isa: int) -> None:
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(t.name for t in m[0]))
@pytest.mark.parametrize("isa", PANEL_ISAS, ids=["avx2", "avx512"])
def test_segments_in_one_call_are_the_single_calls_joined_bit_for_bit(mix, isa):
    skip_missing(isa)
    types, rows, k = mix
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    packed = [
        ext.gguf_pack_panels(random_blocks(t, n, k, rng), int(t), k) for t, n in zip(types, rows, strict=True)
    ]
    ints = [int(t) for t in types]
    for m in (1, 7, 33):
        x = torch.randn(m, k + 3)[:, :k]  # rows with a stride
        out = ext.gguf_matmul_panel_segments(x, packed, ints, list(rows), isa)
        singles = [
            ext.gguf_matmul_panels(x, p, t, n, isa) for p, t, n in zip(packed, ints, rows, strict=True)
        ]
        assert out.shape == (m, sum(rows))
        assert torch.equal(out, torch.cat(singles, -1)), f"{mix} isa {isa} m={m} seed {seed}"
        assert torch.isfinite(out).all()
    # One segment is gguf_matmul_panels; an empty batch is an empty output.
    x = torch.randn(5, k)
    one = ext.gguf_matmul_panel_segments(x, packed[:1], ints[:1], [rows[0]], isa)
    assert torch.equal(one, ext.gguf_matmul_panels(x, packed[0], ints[0], rows[0], isa))
    assert ext.gguf_matmul_panel_segments(x[:0], packed, ints, list(rows), isa).shape == (0, sum(rows))


def test_bad_segments_are_refused_in_one_line_naming_the_segment():
    rng = np.random.default_rng(11)
    k = 64
    q5 = ext.gguf_pack_panels(random_blocks(T.Q5_0, 40, k, rng), int(T.Q5_0), k)
    q8 = ext.gguf_pack_panels(random_blocks(T.Q8_0, 24, k, rng), int(T.Q8_0), k)
    x = torch.randn(2, k)
    op = ext.gguf_matmul_panel_segments
    with pytest.raises(RuntimeError, match="got 2 packed, 1 types, 2 row counts"):
        op(x, [q5, q8], [int(T.Q5_0)], [40, 24])
    with pytest.raises(RuntimeError, match="got 2 packed, 2 types, 3 row counts"):
        op(x, [q5, q8], [int(T.Q5_0), int(T.Q8_0)], [40, 24, 8])
    with pytest.raises(RuntimeError, match="at least one"):
        op(x, [], [], [])
    # q8 packed for 24 rows, given as 40: the wrong number of panels.
    with pytest.raises(
        RuntimeError, match="segment 1: packed must be gguf_pack_panels' output for N = 40, K = 64"
    ):
        op(x, [q5, q8], [int(T.Q5_0), int(T.Q8_0)], [40, 40])
    # The Q5_0 panels read as Q8_0's: the wrong bytes a panel.
    with pytest.raises(RuntimeError, match="segment 0: packed must be gguf_pack_panels' output for N = 40"):
        op(x, [q5, q8], [int(T.Q8_0), int(T.Q8_0)], [40, 24])
    with pytest.raises(RuntimeError, match="segment 1: K must be a multiple of 256 for the K-quants, got 64"):
        op(x, [q5, q8], [int(T.Q5_0), int(T.Q4_K)], [40, 24])
    with pytest.raises(RuntimeError, match=r"segment 1: type 20 is not one of Q4_0 \(2\)"):
        op(x, [q5, q8], [int(T.Q5_0), 20], [40, 24])
    with pytest.raises(RuntimeError, match="segment 0: row count -40 is negative"):
        op(x, [q5, q8], [int(T.Q5_0), int(T.Q8_0)], [-40, 24])
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 32, got 48"):
        op(torch.randn(2, 48), [q5, q8], [int(T.Q5_0), int(T.Q8_0)], [40, 24])


def _fused_layer(types, sizes, k, rng, **options) -> GGUFLinear:
    """A fused layer (`prefill: panels`) of random parts of the given types, finalized as the
    loader does."""
    spec = LinearSpec(k, sum(sizes), False, "qkv", output_sizes=sizes)
    layer = GGUFLinear(spec, int8_activations=True, kernel_max_rows=0, panels=True, **options)
    layer._parts = {i: (int(t), random_blocks(t, n, k, rng)) for i, (t, n) in enumerate(zip(types, sizes))}
    layer.finalize()
    return layer


def _segment_path(layer: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """What `forward` computed before the op: each segment on its own, joined."""
    return torch.cat(
        [layer._segment_matmul(x, t, w, n) for (t, w), n in zip(layer.segments, layer.segment_panels)], -1
    )


def _counting(layer: GGUFLinear) -> list[int]:
    """Wrap the layer's bound op: the batch sizes it is called with."""
    op, args, most = layer._fast
    calls: list[int] = []

    def counted(x, *rest):
        calls.append(x.shape[0])
        return op(x, *rest)

    layer._fast = (counted, args, most)
    return calls


def test_a_layer_of_mixed_panel_segments_multiplies_decode_batches_in_one_call():
    """SmolLM2's Q4_K_M qkv (Q5_0 q and k, a Q8_0 v): no K-quant, so every batch takes the op."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    layer = _fused_layer((T.Q5_0, T.Q5_0, T.Q8_0), (32, 16, 16), 160, rng)
    assert layer.segment_panels == [48, 16]
    op, (packed, types, rows), most = layer._fast
    assert op is ext.gguf_matmul_panel_segments and most == sys.maxsize
    assert types == [int(T.Q5_0), int(T.Q8_0)] and rows == [48, 16]
    assert all(a is w for a, (_, w) in zip(packed, layer.segments, strict=True))
    calls = _counting(layer)
    for m in (1, 40):
        x = torch.randn(m, 160)
        assert torch.equal(layer(x), _segment_path(layer, x)), f"m={m} seed {seed}"
    assert calls == [1, 40]


def test_k_quant_segments_take_the_one_call_up_to_kq_max_rows_then_the_segment_path():
    """Q4_K_M's qkv (Q4_K q and k, a Q6_K v), `kq_max_rows` 5: batches up to 5 rows take the op,
    larger ones the segments (slabs rebuilt from the panels), as before. Where AVX2 is the widest
    code Q6_K keeps its blocks, so the layer binds no op."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    layer = _fused_layer((T.Q4_K, T.Q4_K, T.Q6_K), (16, 16, 17), 256, rng, kq_max_rows=5)
    if int(T.Q6_K) not in panel_types(ext.best_isa()):
        assert layer.segment_panels == [32, None] and layer._fast is None
        return
    assert layer._fast[0] is ext.gguf_matmul_panel_segments and layer._fast[2] == 5
    calls = _counting(layer)
    for m in (1, 5, 9):
        x = torch.randn(m, 256)
        assert torch.equal(layer(x), _segment_path(layer, x)), f"m={m} seed {seed}"
    assert calls == [1, 5]


def test_an_extension_built_before_the_op_keeps_the_segment_path(monkeypatch):
    class Older:  # the extension without gguf_matmul_panel_segments
        def __getattr__(self, name):
            if name == "gguf_matmul_panel_segments":
                raise AttributeError(name)
            return getattr(ext, name)

    monkeypatch.setattr(linear, "native_kernel", lambda: Older())
    rng = np.random.default_rng(2)
    layer = _fused_layer((T.Q5_0, T.Q8_0), (16, 16), 64, rng)
    assert layer.segment_panels == [16, 16] and layer._fast is None
    x = torch.randn(1, 64)
    assert torch.equal(
        layer(x), torch.cat([ext.gguf_matmul_panels(x, w, t, 16) for t, w in layer.segments], -1)
    )


def test_a_layer_with_a_segment_in_blocks_binds_no_one_call():
    """A Q3_K segment keeps its blocks (no panels): the layer keeps the per-segment path."""
    rng = np.random.default_rng(4)
    spec = LinearSpec(256, 32, False, "qkv", output_sizes=(16, 16))
    layer = GGUFLinear(spec, int8_activations=True, kernel_max_rows=0, panels=True)
    q3 = np.zeros((16, GGML_QUANT_SIZES[T.Q3_K][1]), dtype=np.uint8)
    layer._parts = {
        0: (int(T.Q5_0), random_blocks(T.Q5_0, 16, 256, rng)),
        1: (int(T.Q3_K), torch.from_numpy(q3)),
    }
    layer.finalize()
    assert layer.segment_panels == [16, None] and layer._fast is None
