"""Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K in 16-row panels (csrc/gguf_matmul.cpp, `gguf_pack_panels` /
`gguf_matmul_panels`): the blocks come back from the panels byte for byte; the product is (x
rounded per 32-block) @ the gguf package's dequantized weights within the int8-activation tests'
bound, on each panel ISA the CPU has (AVX2, AVX-512 VNNI), M 1 / 7 / 64, odd N, short K; a row's
bits are the same alone and in a batch of 64; the 5- and 6-bit codes' int16 sums do not saturate;
the K-quants' slabs rebuilt from the panels bit for bit; `GGUFLinear` keeps such layers (and a
legacy segment beside them) only as panels; a tiny model served from a file of each type through
the panels, and a Q4_K_M one's prompt unchanged by them. Random blocks with a fresh seed each
run (printed on failure)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from lmstack.interfaces import LinearSpec
from lmstack.model.memory import resident_weight_bytes
from lmstack_gguf import native
from lmstack_gguf.kernel import KQ_MAX_ROWS, panel_types
from lmstack_gguf.linear import GGUFLinear
from lmstack_gguf.plugin import GGUFOptions

ext = None if native.load_error() else native.load()
pytestmark = pytest.mark.skipif(
    ext is None or ext.best_isa() < 1, reason="the panel kernel needs AVX2 and the built kernels"
)

TYPES = [T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
FIVE_BIT = [T.Q5_0, T.Q5_1]
KQUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]  # 256-value super-blocks
FP16_AT = {
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q8_0: (0,),
}  # where a block keeps its fp16 scales
# Panel bytes a row per super-block: Q4_K / Q5_K spread their 6-bit scale / min pairs to bytes.
PANEL_SUPER_BYTES = {T.Q4_K: 148, T.Q5_K: 180, T.Q6_K: 210}
PANEL_ISAS = [1, 2]
isa_ids = ["avx2", "avx512"]


def held_in_panels(*types: T) -> None:
    """Skip where this CPU's widest panel code keeps one of `types` as blocks instead (Q6_K: panels
    with AVX-512 VNNI only, `test_q6_k_takes_panels_only_with_avx512`)."""
    missing = [t.name for t in types if int(t) not in panel_types(ext.best_isa())]
    if missing:
        pytest.skip(f"{', '.join(missing)} kept as blocks here: panels with AVX-512 VNNI only")


def random_blocks(typ: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes]: random codes (fifth bits, 6-bit scales), finite fp16 d (and m / dmin), some
    zero or subnormal."""
    values, size = GGML_QUANT_SIZES[typ]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in FP16_AT[typ]:
        d = (rng.standard_normal((n, k // values)) * 0.01).astype(np.float16)
        special = rng.random(d.shape)
        d[special < 0.05] = 0.0
        d[(special >= 0.05) & (special < 0.1)] = np.float16(3e-6)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, typ: T) -> torch.Tensor:
    n = raw.shape[0]
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, typ), dtype=np.float32)).reshape(
        n, -1
    )


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels multiply it: int8 q * dx per 32-block (`quantize_q8`)."""
    q, dx, _ = ext.quantize_q8(x)
    m, k = x.shape
    return (q.double().reshape(m, -1, 32) * dx.double()[..., None]).reshape(m, k)


def within_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """out vs x @ w^T in float64: each output within a few fp32 ulps of the sum of magnitudes (the
    bound test_gguf_kernel / test_kquant_kernel hold the int8-activation kernels to)."""
    ref = x.double() @ w.double().T
    mag = x.abs().double() @ w.abs().double().T
    return bool(torch.all((out.double() - ref).abs() <= 8 * (k + 4) * 2**-24 * mag + 1e-30))


def skip_missing(isa: int) -> None:
    if isa > ext.best_isa():
        pytest.skip(f"this CPU lacks {native.ISA_NAMES[isa]}")


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", PANEL_ISAS, ids=isa_ids)
def test_q5_panels_are_the_rounded_x_times_the_dequantized_blocks(typ, isa):
    """Panel shapes: one row of a single panel, odd N (a partly filled last panel, a lone last
    panel of a pair), M 1 / 7 / 64, K of 1-18 blocks, rows of x with a stride."""
    skip_missing(isa)
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    shapes = [(1, 1, 32), (1, 37, 288), (7, 33, 224), (64, 17, 576), (64, 51, 96)]
    shapes.append((int(rng.integers(1, 65)), int(rng.integers(1, 80)), 32 * int(rng.integers(1, 19))))
    if typ in KQUANTS:  # whole super-blocks
        shapes = [(m, n, 256 * -(-k // 256)) for m, n, k in shapes]
    for m, n, k in shapes:
        raw = torch.from_numpy(random_blocks(typ, n, k, rng))
        packed = ext.gguf_pack_panels(raw, int(typ), k)
        # The panels hold exactly the blocks' bytes (16 rows a panel; zero rows pad N); Q4_K's
        # 6-bit scale / min pairs as bytes, 148 bytes a super-block row for 144.
        size = GGML_QUANT_SIZES[typ][1]
        per_row = raw.shape[1] // size * PANEL_SUPER_BYTES[typ] if typ in KQUANTS else raw.shape[1]
        assert packed.numel() == -(-n // 16) * 16 * per_row
        ids = torch.from_numpy(rng.permutation(n))
        assert torch.equal(ext.gguf_panel_blocks(packed, int(typ), k, ids), raw[ids])
        x = torch.randn(m, k + int(rng.integers(1, 5)))[:, :k]
        out = ext.gguf_matmul_panels(x, packed, int(typ), n, isa)
        w = dequantized(raw.numpy(), typ)
        assert out.shape == (m, n) and within_rounding(out, rounded_x(x), w, k), (
            f"{typ.name} isa {isa} m={m} n={n} k={k} seed {seed}"
        )
        # The block kernel (kq_matmul_q8) computes the same product: within twice the bound.
        kq = ext.kq_matmul_q8(x, raw, int(typ))
        mag = rounded_x(x).abs() @ w.abs().double().T
        assert torch.all((out.double() - kq.double()).abs() <= 16 * (k + 4) * 2**-24 * mag + 1e-30)


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", PANEL_ISAS, ids=isa_ids)
def test_q5_panel_rows_are_alike_whatever_the_batch(typ, isa):
    """Each of 64 rows alone, and any slice of the batch, gives the bits it gets in the batch."""
    skip_missing(isa)
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 70)), (256 if typ in KQUANTS else 32) * int(rng.integers(1, 7))
    raw = torch.from_numpy(random_blocks(typ, n, k, rng))
    packed = ext.gguf_pack_panels(raw, int(typ), k)
    x = torch.randn(64, k)
    batched = ext.gguf_matmul_panels(x, packed, int(typ), n, isa)
    alone = torch.cat([ext.gguf_matmul_panels(x[i : i + 1], packed, int(typ), n, isa) for i in range(64)])
    assert torch.equal(batched, alone), f"{typ.name} isa {isa} n={n} k={k} seed {seed}"
    start, stop = sorted(int(v) for v in rng.integers(0, 65, 2))
    if stop > start:
        assert torch.equal(
            ext.gguf_matmul_panels(x[start:stop], packed, int(typ), n, isa), batched[start:stop]
        )


@pytest.mark.parametrize("typ", [T.Q4_0, T.Q4_1, T.Q8_0, *TYPES], ids=lambda t: t.name)
@pytest.mark.parametrize("isa", PANEL_ISAS, ids=isa_ids)
def test_large_batches_widen_each_panel_pair_once_and_keep_every_rows_bits(typ, isa):
    """Batches of the 5- and 6-bit kinds from 32 rows (AVX2) or 64 (AVX-512) widen a panel pair's
    (AVX2: a half's) codes to bytes once and run every row tile over them (`wide_pair`,
    `wide_half`), and AVX-512 batches under 64 rows (Q6_K: 32) run one panel at a time in tiles of
    8 rows and one of the rest (`TALL`): each row gets the bits it gets alone (the per-tile path), whatever the batch's
    size around the thresholds, with a lone last panel and partial row tiles, and in a batch of
    600; the other kinds keep the per-tile path and the same rule; the product stays within the
    rounding bound."""
    skip_missing(isa)
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    k = (256 if typ in KQUANTS else 32) * int(rng.integers(1, 4))
    n = 16 * int(rng.integers(1, 3)) * 2 + int(rng.integers(1, 16))  # pairs, then a lone partial panel
    raw = torch.from_numpy(random_blocks(typ, n, k, rng))
    packed = ext.gguf_pack_panels(raw, int(typ), k)
    x = torch.randn(70, k) * float(rng.choice((1e-3, 1.0, 50.0)))
    alone = torch.cat([ext.gguf_matmul_panels(x[i : i + 1], packed, int(typ), n, isa) for i in range(70)])
    for m in (2, 5, 7, 8, 9, 16, 23, 31, 32, 33, 63, 64, 65, 70):
        out = ext.gguf_matmul_panels(x[:m], packed, int(typ), n, isa)
        assert torch.equal(out, alone[:m]), f"{typ.name} m={m} n={n} k={k} seed {seed}"
    w = dequantized(raw.numpy(), typ)
    assert within_rounding(alone, rounded_x(x), w, k), f"{typ.name} n={n} k={k} seed {seed}"
    # A prefill-sized batch against the same rows in calls of 64 and one of the rest (the bias
    # sums of each row, where a kind has them, found at its offset).
    big = torch.randn(600, k)
    out = ext.gguf_matmul_panels(big, packed, int(typ), n, isa)
    parts = [ext.gguf_matmul_panels(big[r : r + 64], packed, int(typ), n, isa) for r in range(0, 600, 64)]
    assert torch.equal(out, torch.cat(parts)), f"{typ.name} m=600 n={n} k={k} seed {seed}"


@pytest.mark.parametrize("typ", [*FIVE_BIT, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("isa", PANEL_ISAS, ids=isa_ids)
def test_panels_largest_codes_do_not_saturate(typ, isa):
    """Every code 31 (Q5_x, Q5_K: fifth bits all set) or 63 (Q6_K) against x rounded to +-127: AVX2 sums
    maddubs products in int16, which must widen before 2^15 (a saturated sum would be off by
    thousands)."""
    skip_missing(isa)
    n, k = 20, 256
    values, size = GGML_QUANT_SIZES[typ]
    raw = np.zeros((n, k // values, size), dtype=np.uint8)
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    if typ == T.Q6_K:
        raw[:, :, :192] = 0xFF  # codes 63
        raw[:, :, 192:208] = 1  # scales
        raw[:, :, 208:] = one
    elif typ == T.Q5_K:
        raw[:, :, :2] = one  # d 1, dmin 0
        raw[:, :, 4:8] = 1  # scales 0-3: 1, mins 0-3: 0
        raw[:, :, 12:16] = 1  # scales 4-7: 1, mins 4-7: 0
        raw[:, :, 16:] = 0xFF  # fifth bits and codes: 31
    else:
        raw[:, :, :2] = one
        raw[:, :, 4 if typ == T.Q5_1 else 2 :] = 0xFF  # Q5_1's m stays 0
    raw = torch.from_numpy(raw.reshape(n, -1))
    x = torch.full((3, k), 2.0)
    x[1] = -2.0
    x[2, ::2] = -2.0
    packed = ext.gguf_pack_panels(raw, int(typ), k)
    out = ext.gguf_matmul_panels(x, packed, int(typ), n, isa)
    w = dequantized(raw.numpy(), typ)
    assert torch.all(w == {T.Q5_0: 15.0, T.Q5_1: 31.0, T.Q5_K: 31.0, T.Q6_K: 31.0}[typ])
    assert within_rounding(out, rounded_x(x), w, k)
    # The same rows in a batch of 66 (codes widened once per panel pair or half: `wide_pair`).
    big = x.repeat(22, 1)
    assert torch.equal(ext.gguf_matmul_panels(big, packed, int(typ), n, isa), out.repeat(22, 1))


def test_q5_pack_refuses_rows_of_the_wrong_size_in_one_line():
    raw = torch.zeros(4, 2 * 22, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="w rows hold 44 bytes; K = 96 needs 66"):
        ext.gguf_pack_panels(raw, int(T.Q5_0), 96)
    packed = ext.gguf_pack_panels(raw, int(T.Q5_0), 64)
    with pytest.raises(RuntimeError, match="gguf_pack_panels' output for N = 4, K = 64"):
        ext.gguf_matmul_panels(torch.randn(2, 64), packed, int(T.Q5_1), 4)
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 256, got 288"):
        ext.gguf_pack_panels(torch.zeros(4, 162, dtype=torch.uint8), int(T.Q4_K), 288)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256 for the K-quants, got 64"):
        ext.gguf_matmul_panels(torch.randn(2, 64), packed, int(T.Q4_K), 4)


@pytest.mark.parametrize("typ", KQUANTS, ids=lambda t: t.name)
def test_k_quant_panels_dequantize_to_the_blocks_values_bit_for_bit(typ):
    """`kq_panel_dequantize` (the slabs of a Q4_K / Q6_K layer kept as panels): any row range,
    fp32 and bf16, exactly `kq_dequantize`'s values (the gguf package's, bit for bit)."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 60)), 256 * int(rng.integers(1, 5))
    raw = torch.from_numpy(random_blocks(typ, n, k, rng))
    packed = ext.gguf_pack_panels(raw, int(typ), k)
    ref = ext.kq_dequantize(raw, int(typ), k)
    assert torch.equal(ref.view(torch.int32), dequantized(raw.numpy(), typ).view(torch.int32))
    r0 = int(rng.integers(0, n))
    r1 = int(rng.integers(r0, n + 1))
    for dtype in (torch.float32, torch.bfloat16):
        into = torch.empty(r1 - r0, k, dtype=dtype)
        ext.kq_panel_dequantize(packed, int(typ), k, r0, r1, into)
        assert torch.equal(into, ref[r0:r1].to(dtype)), f"{dtype} n={n} k={k} rows {r0}:{r1} seed {seed}"
    with pytest.raises(RuntimeError, match=r"rows \[0, 100\) are not in the panels"):
        ext.kq_panel_dequantize(packed, int(typ), k, 0, 100, torch.empty(100, k))


@pytest.mark.parametrize("typ", KQUANTS, ids=lambda t: t.name)
def test_k_quant_panels_take_decode_batches_and_slabs_take_larger_ones_as_before(typ):
    """`kquant_batches: slabs` (the default without AVX-512): a Q4_K / Q6_K layer kept as panels multiplies batches up to
    `kq_max_rows` by the panels, larger ones by slabs rebuilt from them — the bits the blocks'
    slabs gave (x unrounded); with `kq_max_rows` None (`kquant_batches: int8`) panels take all."""
    held_in_panels(typ)
    from lmstack_gguf.kernel import dequant_matmul

    rng = np.random.default_rng(7)
    n, k = 40, 512
    raw = torch.from_numpy(random_blocks(typ, n, k, rng))
    dense = dequantized(raw.numpy(), typ)
    for slab_dtype in (torch.float32, torch.bfloat16):
        layer = GGUFLinear(
            LinearSpec(k, n, False, "x"),
            int8_activations=True,
            kernel_max_rows=0,
            panels=True,
            kq_max_rows=5,
            slab_dtype=slab_dtype,
        )
        layer.set_blocks(int(typ), raw.clone())
        ((_, packed),) = layer.segments
        x = torch.randn(9, k)
        assert torch.equal(layer(x[:5]), ext.gguf_matmul_panels(x[:5], packed, int(typ), n))
        before = dequant_matmul(x.to(slab_dtype), raw, int(typ), k).float()  # the blocks' slabs
        assert torch.equal(layer(x), before)
    every = GGUFLinear(
        LinearSpec(k, n, False, "x"), int8_activations=True, kernel_max_rows=0, panels=True, kq_max_rows=None
    )
    every.set_blocks(int(typ), raw.clone())
    x = torch.randn(70, k)
    assert within_rounding(every(x), rounded_x(x), dense, k)


def test_q6_k_takes_panels_only_with_avx512(monkeypatch):
    """Where AVX2 is the widest code a Q6_K layer keeps its blocks (kq: its AVX2 panels were
    slower); the other types take the panels on both ISAs."""
    from lmstack_gguf import linear

    assert int(T.Q6_K) in panel_types(2) and int(T.Q6_K) not in panel_types(1)
    assert panel_types(1) >= {int(t) for t in (T.Q5_0, T.Q5_1, T.Q4_K, T.Q8_0)}
    monkeypatch.setattr(linear, "panel_types", lambda isa: panel_types(1))
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(random_blocks(T.Q6_K, 32, 256, rng))
    layer = _panel_layer(LinearSpec(256, 32, False, "x"))
    layer.set_blocks(int(T.Q6_K), raw.clone())
    assert layer.segment_panels == [None] and torch.equal(layer.weight.data, raw)
    x = torch.randn(3, 256)
    assert within_rounding(layer(x), rounded_x(x), dequantized(raw.numpy(), T.Q6_K), 256)


def _panel_layer(spec: LinearSpec, **kq) -> GGUFLinear:
    """A layer as `prefill: panels` makes it: int8 activations, panels for every batch (a Q4_K
    one up to `kq_max_rows`, KQ_MAX_ROWS unless given)."""
    return GGUFLinear(spec, int8_activations=True, kernel_max_rows=0, panels=True, **kq)


@pytest.mark.parametrize("typ", TYPES, ids=lambda t: t.name)
def test_a_layer_keeps_only_panels_and_multiplies_every_batch_by_them(typ):
    held_in_panels(typ)
    rng = np.random.default_rng(int(typ))
    n, k = 48, 256
    raw = torch.from_numpy(random_blocks(typ, n, k, rng))
    dense = dequantized(raw.numpy(), typ)
    layer = _panel_layer(LinearSpec(k, n, False, "x"), kq_max_rows=None)  # kquant_batches: int8
    layer.set_blocks(int(typ), raw.clone())
    assert layer.ggml_type == int(typ) and layer.segment_panels == [n] and layer.weight.numel() == 0
    ((t, packed),) = layer.segments
    # The file's bytes, re-laid (Q4_K / Q5_K: 148 / 180 bytes a super-block row for 144 / 176).
    size = GGML_QUANT_SIZES[typ][1]
    want = raw.nbytes // size * PANEL_SUPER_BYTES[typ] if typ in KQUANTS else raw.nbytes
    assert resident_weight_bytes(layer) == want
    for m in (1, 7, 64):
        x = torch.randn(m, k)
        out = layer(x)
        assert torch.equal(out, ext.gguf_matmul_panels(x, packed, int(typ), n))
        assert within_rounding(out, rounded_x(x), dense, k)
    ids = torch.tensor([0, 47, 5, 5, 16])
    assert torch.equal(layer.rows(ids), dense[ids])
    assert "48 rows " + typ.name + " in 16-row panels" in layer.extra_repr()


def test_a_mixed_layer_takes_panels_for_its_panel_types_and_kq_for_the_k_quants():
    """SmolLM2's Q4_K_M qkv: Q5_0 q and k, a Q8_0 v (llama-quantize's fallbacks), here with Q4_K,
    Q6_K and Q3_K parts too: all but Q3_K (its blocks, kq) as panels; the rows of the types that
    take the panels at 64 rows alike in any batch."""
    held_in_panels(T.Q6_K)
    from lmstack.testing.gguf_quants import quantize

    rng = np.random.default_rng(5)
    k, sizes = 256, (32, 16, 16, 16, 16, 16)
    w = [rng.standard_normal((s, k)).astype(np.float32) for s in sizes]
    types = (T.Q5_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q3_K)
    raws = [quantize(a, t) if t != T.Q8_0 else quants.quantize(a, t) for a, t in zip(w, types)]
    dense = torch.cat([dequantized(r, t) for r, t in zip(raws, types)])
    spec = LinearSpec(k, sum(sizes), False, "qkv", output_sizes=sizes)
    layer = _panel_layer(spec)
    layer._parts = {i: (int(t), torch.from_numpy(r)) for i, (r, t) in enumerate(zip(raws, types))}
    layer.finalize()
    assert [t for t, _ in layer.segments] == [int(t) for t in (T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q3_K)]
    assert layer.segment_panels == [48, 16, 16, 16, None] and layer.ggml_type is None
    x = torch.randn(64, k)
    out = layer(x)
    # (64 rows: the K-quant segments multiply x unrounded, by fp32 slabs: KQ_MAX_ROWS)
    assert within_rounding(out[:, :64], rounded_x(x), dense[:64], k)
    assert within_rounding(out[:, 64:], x, dense[64:], k)
    assert within_rounding(layer(x[:8]), rounded_x(x[:8]), dense, k)
    picked = [0, 31, 63]
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in picked])[:, :64], out[picked, :64])
    ids = torch.tensor([0, 47, 48, 63, 64, 79, 80, 95, 96, 111])
    assert torch.equal(layer.rows(ids), dense[ids])


def test_kq_panels_every_batch_sends_the_k_quant_panels_every_batch_and_leaves_kq_blocks_their_limit():
    """`kq_panels_every_batch` (`kquant_batches: auto` with AVX-512 VNNI): the mixed layer above at
    64 rows multiplies its Q4_K / Q6_K panels with x rounded, every row's bits as alone; its Q3_K
    blocks (no panels) keep `kq_max_rows` and their slabs (x unrounded)."""
    held_in_panels(T.Q6_K)
    from lmstack.testing.gguf_quants import quantize

    rng = np.random.default_rng(6)
    k, sizes = 256, (16, 16, 16, 16)
    types = (T.Q5_0, T.Q4_K, T.Q6_K, T.Q3_K)
    raws = [quantize(rng.standard_normal((s, k)).astype(np.float32), t) for s, t in zip(sizes, types)]
    dense = torch.cat([dequantized(r, t) for r, t in zip(raws, types)])
    layer = _panel_layer(
        LinearSpec(k, sum(sizes), False, "qkv", output_sizes=sizes), kq_panels_every_batch=True
    )
    layer._parts = {i: (int(t), torch.from_numpy(r)) for i, (r, t) in enumerate(zip(raws, types))}
    layer.finalize()
    assert layer.segment_panels == [16, 16, 16, None]
    assert layer.kq_max_rows == KQ_MAX_ROWS and layer.kq_panel_max_rows > 64
    x = torch.randn(64, k)
    out = layer(x)
    assert within_rounding(out[:, :48], rounded_x(x), dense[:48], k)
    assert within_rounding(out[:, 48:], x, dense[48:], k)  # the Q3_K blocks' slabs: x unrounded
    picked = [0, 17, 63]
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in picked])[:, :48], out[picked, :48])


def test_kquant_batches_auto_resolves_to_the_panels_for_every_batch_only_with_avx512(monkeypatch):
    """`kquant_batches: auto` (the default): the layers' K-quant panels take every batch where the
    panels run with AVX-512 VNNI, their `kq_max_rows` elsewhere; `slabs` keeps the limit anywhere."""
    from lmstack_gguf import quantizer as q

    def layer_of(options: dict, wide: bool) -> GGUFLinear:
        monkeypatch.setattr(q, "wide_panels_cpu", lambda: wide)
        quant = object.__new__(q.GGUFQuantizer)
        quant.options = GGUFOptions(**options)
        quant.use_native, quant.int8_activations, quant.prefill = True, True, "panels"
        quant.panels, quant.dense_copy, quant.slab_dtype = True, False, torch.bfloat16
        return quant.linear_factory()(LinearSpec(256, 16, False, "x"))

    assert layer_of({}, True).kq_panel_max_rows > 10**6
    assert layer_of({}, False).kq_panel_max_rows == KQ_MAX_ROWS
    assert layer_of({"kquant_batches": "slabs"}, True).kq_panel_max_rows == KQ_MAX_ROWS
    assert layer_of({"kquant_batches": "int8"}, False).kq_panel_max_rows > 10**6
    assert layer_of({}, True).kq_max_rows == KQ_MAX_ROWS  # blocks (no panels) keep their slabs


PROMPT = list(range(3, 43))  # above KQ_MAX_ROWS: a Q4_K prompt takes the slabs by default


def _tiny_file(family: str, kind: str, root) -> object:
    from lmstack.testing.gguf_writer import write_gguf
    from lmstack.testing.tiny_families import write_tiny_family

    return write_gguf(
        write_tiny_family(family, root / "hf"), root / f"{family}.{kind}.gguf", tensor_type=kind
    )


def _serve(path, quant: dict, **stack):
    """(greedy tokens, prompt log-probabilities, model, resident weight bytes) of one engine."""
    from lmstack.engine.llm import LLM
    from lmstack.sampling_params import SamplingParams
    from lmstack.stack.plugins import make_plugin_manager
    from lmstack.testing.kit import one_thread, tiny_stack

    llm = LLM(
        {**tiny_stack(path, max_model_len=64), "attention": "cpu-paged", "quant": quant, **stack},
        plugin_manager=make_plugin_manager(),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
        with one_thread():
            out = llm.generate(PROMPT, params)[0]
        logprobs = torch.tensor([out.prompt_logprobs[i][PROMPT[i]] for i in range(1, len(PROMPT))])
        model = llm.engine.executor.runner.model
        return out.outputs[0].token_ids, logprobs, model, resident_weight_bytes(model)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_a_model_served_through_the_panels(kind, tmp_path):
    """A tiny qwen3 written as Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K: the default stack (int8 activations,
    `prefill: panels`; the K-quants with `kquant_batches: int8`, so that the prompt takes the
    panels too) holds every
    layer as panels within 5 % of the file's tensor bytes; the first greedy token is the
    dequantized file's (`weights: none`) and the prompt log-probabilities stay within the int8
    rounding's bound; prefilled in chunks of 8 rows every row gets the same bits."""
    pytest.importorskip("transformers")
    from lmstack.model.gguf_file import read_gguf

    path = _tiny_file("qwen3", kind, tmp_path)
    expected, theirs, _, _ = _serve(path, {"weights": "none"})
    gguf_quant = {
        "weights": "gguf",
        "kv_cache": "none",
        **({"kquant_batches": "int8"} if kind.endswith("_k") else {}),
    }
    tokens, ours, model, resident = _serve(path, gguf_quant)
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear) and m is not model.lm_head]
    qtype = int(T[kind.upper()])
    in_panels = qtype in panel_types(ext.best_isa())  # Q6_K: AVX-512 VNNI only
    assert layers and all(m.segment_panels == [m.out_features if in_panels else None] for m in layers)
    assert {m.ggml_type for m in layers} == {qtype}
    file_bytes = sum(int(t.data.nbytes) for t in read_gguf(path).tensors.values())
    rope = sum(b.nbytes for m in model.modules() if "Rotary" in type(m).__name__ for b in m.buffers())
    assert resident <= 1.05 * file_bytes + rope, (resident, file_bytes)
    diffs = (ours - theirs).abs()
    assert 1e-4 < diffs.max() < 1.5 and diffs.mean() < 0.3, (diffs.mean(), diffs.max())
    assert tokens[0] == expected[0]
    chunked = {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 8}
    tokens_chunked, pieces, _, _ = _serve(path, gguf_quant, scheduler=chunked)
    assert tokens_chunked == tokens and torch.equal(pieces, ours)


def test_a_q4_k_m_model_prompt_is_unchanged_by_the_panels(tmp_path):
    """A tiny llama written as Q4_K_M (Q4_K, Q6_K for v / down), `kquant_batches: slabs`: its Q4_K
    and Q6_K layers are panels, and the 40-token prompt's log-probabilities are bit for bit what the blocks
    give (`prefill: dense-copy`: no panels, the Q4_K blocks through kq and slabs, as before the
    panels), since prefill above KQ_MAX_ROWS multiplies slabs rebuilt from the panels; the greedy
    tokens (decode through the panels, kq before) are the same. (`lm_head: dense`: this tiny llama
    ties its head to the Q4_K embedding, which as a packed table takes the panels at every batch,
    kq before: the same products summed in another order.)"""
    held_in_panels(T.Q6_K)  # the premise: its Q6_K layers are panels too
    pytest.importorskip("transformers")
    path = _tiny_file("llama3", "q4_k_m", tmp_path)
    # (`kquant_batches: slabs`: the default's `auto` sends prefill through the panels with AVX-512.)
    quant = {"weights": "gguf", "kv_cache": "none", "lm_head": "dense", "kquant_batches": "slabs"}
    before_tokens, before, old_model, _ = _serve(path, {**quant, "prefill": "dense-copy"})
    assert not any(n for m in old_model.modules() if isinstance(m, GGUFLinear) for n in m.segment_panels if n)
    tokens, ours, model, _ = _serve(path, quant)
    panels = {
        m.ggml_type for m in model.modules() if isinstance(m, GGUFLinear) and m.segment_panels[:1] != [None]
    }
    assert {int(T.Q4_K), int(T.Q6_K)} & panel_types(ext.best_isa()) <= panels and int(T.Q4_K) in panels
    assert torch.equal(ours, before) and tokens == before_tokens
