"""cpu-paged against the conformance kit and the plain torch reference, on every code path this
CPU can run; the clear refusal where the extension cannot be built.

The kit draws fresh random inputs each run: odd context and query lengths, block sizes 1/4/16,
GQA ratios 1/3/8, fp32 and bf16 queries, bf16 and scaled fp8 caches, sliding windows (also
changing from layer to layer), tanh soft-capping of the scores.
"""

from __future__ import annotations

import itertools
import platform
import shutil
import subprocess

import pytest
import torch

from lmstack.testing import AttentionConformance, paged_batch, reference_attention
from lmstack.testing.attention import rel_error
from lmstack_cpu_paged import build as builder
from lmstack_cpu_paged.plugin import COMPONENT

if builder.load_error() is not None:
    pytest.skip(f"cpu-paged cannot be built here: {builder.load_error()}", allow_module_level=True)

BEST = builder.load().best_isa()
RUNNABLE = [isa for isa, level in (("scalar", 0), ("avx2", 1), ("avx512", 2)) if level <= BEST]


class TestCpuPagedConformance(AttentionConformance):
    component = COMPONENT
    head_dims = (64, 80, 128)  # 80: a head dim that is not a multiple of the vector width


class TestCpuPagedScalarConformance(AttentionConformance):
    """The plain C++ path (what a CPU without AVX2 runs), on a smaller random matrix."""

    component = COMPONENT
    options = {"isa": "scalar"}
    head_dims = (64, 72)
    cases = 6


def _batch(spans, hkv, group, head_dim, block_size, dtype=torch.float32):
    q, _, _, kc, vc, meta, dense = paged_batch(spans, hkv, group, head_dim, block_size, dtype)
    return q, kc, vc, meta, dense


def _expect(q, meta, dense, scale, window=None, softcap=None):
    out, start = [], 0
    for (k, v), c, ql in zip(dense, meta.context_lens_cpu, meta.query_lens_cpu):
        out.append(reference_attention(q[start : start + ql], k, v, c, scale, window, softcap))
        start += ql
    return torch.cat(out)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("min_part", [32, 256])
def test_decode_split_over_long_contexts(isa, min_part):
    """Batch 1-2 with long contexts: the kernel splits the keys over threads (min_part 32: many
    parts, some emptied by the window) and merges the parts' softmax states."""
    backend = COMPONENT.factory(COMPONENT.options_type(isa=isa, min_part=min_part), None)
    for window in (None, 50):
        q, kc, vc, meta, dense = _batch([(1500, 1), (77, 1)], hkv=2, group=4, head_dim=64, block_size=16)
        out = backend.decode(q, kc, vc, meta, scale=0.125, sliding_window=window)
        assert rel_error(out, _expect(q, meta, dense, 0.125, window)) < 2e-5


@pytest.mark.parametrize("isa", RUNNABLE)
def test_prefill_mixed_batch_with_windows(isa):
    """Decode rows and prefill chunks over cached context in one call, GQA 3, a window."""
    backend = COMPONENT.factory(COMPONENT.options_type(isa=isa), None)
    spans = [(0, 1), (40, 1), (0, 130), (333, 67), (5, 1)]
    spans.sort(key=lambda s: s[1] != 1)  # decode sequences first, as the engine orders them
    for window in (None, 7):
        q, kc, vc, meta, dense = _batch(spans, hkv=3, group=3, head_dim=64, block_size=16)
        out = backend.prefill(q, None, None, kc, vc, meta, scale=0.125, sliding_window=window)
        assert rel_error(out, _expect(q, meta, dense, 0.125, window)) < 2e-5


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_softcap_and_per_layer_windows(isa, kv_dtype):
    """Gemma's attention: scores soft-capped (cap x tanh(score / cap), caps of a few units that
    bend most scores) and windows that change from call to call over the same batch (as the
    layers of one step alternate local and global attention), on the fast path (64, 128) and
    the general one (80: not whole registers), GQA 1 / 3 / 8, decode rows beside prefill chunks
    over cached context, long decode contexts split over threads (min_part 32). Against the
    plain torch reference over the same stored values."""
    spans = [(0, 1), (300, 1), (0, 45), (97, 13), (5, 1)]
    spans.sort(key=lambda s: s[1] != 1)
    for head_dim, group in ((64, 1), (80, 3), (128, 8)):
        q, _, _, kc, vc, meta, dense = paged_batch(spans, 2, group, head_dim, 16, kv_dtype=kv_dtype)
        decode_spans = [(700, 1), (33, 1)]
        qd, _, _, kcd, vcd, meta_d, dense_d = paged_batch(
            decode_spans, 2, group, head_dim, 16, kv_dtype=kv_dtype
        )
        for min_part in (32, 256):
            backend = COMPONENT.factory(COMPONENT.options_type(isa=isa, min_part=min_part), None)
            for window, cap in ((None, 2.5), (9, 2.5), (None, None), (40, 1.0), (9, None)):
                kw = {"scale": 0.4, "sliding_window": window, "logit_softcap": cap}
                out = backend.prefill(q, None, None, kc, vc, meta, **kw)
                ref = _expect(q, meta, dense, 0.4, window, cap)
                assert rel_error(out, ref) < 2e-5, (head_dim, group, window, cap)
                if cap is not None:  # the cap changes the answer by far more than the tolerance
                    assert rel_error(_expect(q, meta, dense, 0.4, window), ref) > 0.05
                out = backend.decode(qd, kcd, vcd, meta_d, **kw)
                assert rel_error(out, _expect(qd, meta_d, dense_d, 0.4, window, cap)) < 2e-5, (
                    head_dim,
                    window,
                    cap,
                )


@pytest.mark.parametrize("isa", RUNNABLE)
def test_bf16_queries_over_bf16_cache_match_fp32_math(isa):
    """bf16 in, bf16 out, fp32 inside: within bf16 output rounding of the fp32 reference."""
    backend = COMPONENT.factory(COMPONENT.options_type(isa=isa), None)
    q, kc, vc, meta, dense = _batch([(900, 1), (3, 1), (20, 45)], 1, 8, 128, 16, dtype=torch.bfloat16)
    out = backend.prefill(q, None, None, kc, vc, meta, scale=128**-0.5, sliding_window=None)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, _expect(q, meta, dense, 128**-0.5)) < 4e-3


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_decode_path_every_head_width_and_group(isa, kv_dtype):
    """Decode items have their own path where the head dim is 1, 2, 4, 8 or 16 whole registers (a
    shuffle tree sums 8 or 16 keys' products at once, V is read once for up to 4 query rows):
    head dims 16-128 cover every register count on AVX2 and AVX-512, groups 1-8 every split of
    the rows, and contexts of odd lengths the partial key tiles. Against the plain reference
    over the same stored values."""
    backend = COMPONENT.factory(COMPONENT.options_type(isa=isa), None)
    spans = [(0, 1), (12, 1), (45, 1), (250, 1), (33, 1)]
    for head_dim in (16, 32, 64, 128):
        for group in (1, 2, 3, 5, 8):
            q, _, _, kc, vc, meta, dense = paged_batch(spans, 2, group, head_dim, 16, kv_dtype=kv_dtype)
            scale = head_dim**-0.5
            out = backend.decode(q, kc, vc, meta, scale=scale, sliding_window=None)
            ref = _expect(q, meta, dense, scale)
            assert rel_error(out, ref) < 2e-5, (head_dim, group)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_code_widens_to_its_value(isa, kv_dtype):
    """The vector paths widen fp8 by way of fp16 (no table): every one of the 256 codes, e4m3's
    subnormals and NaNs included, must come back as torch's value for it. A single cached key
    whose V row holds the codes returns that row (its softmax weight is exactly 1): on the fast
    path (head dims 16, 64), the general one (80), with 1, 8 and 3 query rows per KV head."""
    backend = COMPONENT.factory(COMPONENT.options_type(isa=isa), None)
    codes = torch.arange(256, dtype=torch.uint8)
    for head_dim, group in ((16, 1), (64, 8), (80, 3)):
        hkv = 4
        q, _, _, kc, vc, meta, _ = paged_batch([(0, 1), (0, 1)], hkv, group, head_dim, 16, kv_dtype=kv_dtype)
        n = hkv * head_dim
        row = codes.repeat(-(-n // 256))[:n].roll(head_dim // 2).view(hkv, head_dim)
        vc.view(torch.uint8)[:] = row
        out = backend.decode(q, kc, vc, meta, scale=0.1, sliding_window=None)
        want = row.view(kv_dtype).float().repeat_interleave(group, 0)
        for seq in out:
            torch.testing.assert_close(seq, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_native_fp8_write_stores_the_bytes_torch_would(kv_dtype, src_dtype):
    """The native scaled-fp8 write against the base class's torch path (`quantize_kv`, then the
    bytes copied): the same bytes for values past the format's range (saturated), far below it
    (fp8 subnormals, zeros), NaN, random bit patterns and exact rounding ties, from strided K/V
    views; a decode-sized batch (power-of-two scales, keeping the ties) and a prefill-sized one
    (random scales; spread over threads)."""
    from lmstack.interfaces import AttentionBackend

    backend = COMPONENT.factory(COMPONENT.options_type(), None)
    hkv, d, bs, nb = 3, 64, 16, 40
    gen = torch.Generator().manual_seed(0)
    for tokens in (5, 300):
        x = torch.randn(tokens, 2 * hkv * d + 7, generator=gen)
        x[:, ::5] *= 1e4  # past the largest value once scaled
        x[:, 1::7] *= 1e-5  # subnormals and zeros
        x[0, 3], x[1, 4], x[1, 5] = float("nan"), float("-nan"), float("-inf")
        # Random bit patterns over every exponent from below e4m3's subnormals to past e5m2's
        # range (2^-27 .. 2^18), in K and in V: ties and carries at each scale.
        shape = (tokens, 2, 64)
        exponent = torch.randint(100, 145, shape, generator=gen)
        mantissa, sign = (
            torch.randint(0, 2**23, shape, generator=gen),
            torch.randint(0, 2, shape, generator=gen),
        )
        drawn = (
            ((sign << 31) | (exponent << 23) | mantissa).to(torch.int64).to(torch.int32).view(torch.float32)
        )
        x[:, 100:164], x[:, 300:364] = drawn[:, 0], drawn[:, 1]
        # Exact ties of both formats (scaled by powers of two below, so they stay ties): normal
        # values halfway between two codes, and subnormal ones, (n + 1/2) smallest subnormals.
        for col, drop in ((20, 20), (40, 21), (200, 20), (240, 21)):
            tie = (
                (sign[:, 0, :16] << 31) | (exponent[:, 0, :16] << 23) | (mantissa[:, 0, :16] >> drop << drop)
            )
            x[:, col : col + 16] = (tie | (1 << (drop - 1))).to(torch.int32).view(torch.float32)
        n = torch.arange(16) % 8 + 0.5
        x[:, 60:76], x[:, 260:276] = n * 2.0**-9, -n * 2.0**-16
        x = x.to(src_dtype)
        k, v = x[:, : hkv * d].view(tokens, hkv, d), x[:, hkv * d : 2 * hkv * d].view(tokens, hkv, d)
        k_scale = torch.rand(hkv, generator=gen) + 0.05 if tokens == 300 else torch.tensor([1.0, 0.5, 4.0])
        v_scale = k_scale * (3 if tokens == 300 else 2)
        slots = torch.randperm(nb * bs, generator=gen)[:tokens]
        got = [torch.zeros(nb, bs, hkv, d, dtype=kv_dtype) for _ in range(2)]
        want = [torch.zeros(nb, bs, hkv, d, dtype=kv_dtype) for _ in range(2)]
        backend.write_kv(k, v, *got, slots, k_scale=k_scale, v_scale=v_scale)
        AttentionBackend.write_kv(backend, k, v, *want, slots, k_scale=k_scale, v_scale=v_scale)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (tokens, kv_dtype, src_dtype)


def test_isas_agree():
    """Every runnable code path gives the same answer to fp32 rounding."""
    q, kc, vc, meta, dense = _batch([(700, 1), (10, 30)], hkv=2, group=3, head_dim=96, block_size=4)
    outs = [
        COMPONENT.factory(COMPONENT.options_type(isa=isa), None).prefill(
            q, None, None, kc, vc, meta, scale=0.1, sliding_window=None
        )
        for isa in RUNNABLE
    ]
    for out in outs[1:]:
        assert rel_error(out, outs[0]) < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_dot_scores_agree_with_the_widened_ones(monkeypatch, head_dim):
    """With AVX512_BF16, bf16 K rows are scored by vdpbf16ps against the query rows split into
    bf16 hi and lo parts, not widened to fp32 (`score_rows_dot`); LMSTACK_CPU_PAGED_BF16_DOT=0 (read
    per call) widens them. Decode, prefill and a cached prompt, GQA 3: the two within fp32
    rounding of each other and of the reference, and not the same bits (the dot path ran)."""
    ext = builder.load()
    if BEST < 2 or not ext.bf16_dot():
        pytest.skip("this CPU has no AVX512_BF16")
    q, _, _, kc, vc, meta, dense = paged_batch(
        [(0, 37), (300, 1), (45, 20), (130, 1)], 2, 3, head_dim, 16, kv_dtype=torch.bfloat16
    )
    backend = COMPONENT.factory(COMPONENT.options_type(isa="avx512"), None)
    scale = head_dim**-0.5
    dot = backend.prefill(q, None, None, kc, vc, meta, scale=scale, sliding_window=None)
    monkeypatch.setenv("LMSTACK_CPU_PAGED_BF16_DOT", "0")
    assert not ext.bf16_dot()
    widened = backend.prefill(q, None, None, kc, vc, meta, scale=scale, sliding_window=None)
    assert rel_error(dot, widened) < 1e-5 and not torch.equal(dot, widened)
    assert rel_error(dot, _expect(q, meta, dense, scale)) < 1e-5


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's prefetcht1")
def test_the_built_kernels_prefetch():
    """The kernels' next-tile prefetches are in the object the build made: GCC once left every
    `__builtin_prefetch` of this source out of it without a word (attention_impl.h)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here to read the built extension with")
    text = subprocess.run(
        [objdump, "-d", builder.load().__file__], capture_output=True, text=True, check=True
    )
    assert text.stdout.count("prefetcht1") >= 8  # every kind of the fast and general paths


def test_the_backend_pickles():
    """A multi-process layout sends the backends to its workers: the extension module is left
    out and loaded again, and the copy computes the same bits."""
    import pickle

    backend = COMPONENT.factory(COMPONENT.options_type(min_part=64), None)
    copy = pickle.loads(pickle.dumps(backend))
    assert copy.min_part == 64 and copy.isa == backend.isa
    q, kc, vc, meta, _ = _batch([(70, 1), (3, 1)], hkv=2, group=2, head_dim=64, block_size=16)
    kw = {"scale": 0.125, "sliding_window": 9, "logit_softcap": 3.0}
    assert torch.equal(copy.decode(q, kc, vc, meta, **kw), backend.decode(q, kc, vc, meta, **kw))


def test_build_failure_is_one_clear_line(monkeypatch):
    """A machine that cannot build the extension: resolution names the reason in one line and
    the torch backend still resolves."""
    from lmstack.errors import ResolutionError
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import default_registry
    from lmstack.stack.resolve import resolve

    def no_compiler():
        raise builder.BuildError("no C++ compiler found (install g++ or set CXX)")

    monkeypatch.setattr(builder.EXTENSION, "_compile", no_compiler)
    builder.EXTENSION._load_cached.cache_clear()
    try:
        stack = {"model": "smollm2-135m-instruct", "device": "cpu", "attention": "cpu-paged"}
        with pytest.raises(ResolutionError) as err:
            resolve(load_stack(stack), default_registry())
        message = str(err.value)
        assert "\n" not in message
        assert "cpu-paged" in message and "no C++ compiler found" in message and "torch" in message
        with pytest.raises(builder.BuildError, match="no C\\+\\+ compiler"):
            COMPONENT.factory(COMPONENT.options_type(), None)
        resolve(load_stack({**stack, "attention": "torch"}), default_registry())
    finally:
        builder.EXTENSION._load_cached.cache_clear()


def test_build_entry_point_never_fails(monkeypatch, capsys):
    """`python -m lmstack_cpu_paged.build` (run by make install) exits 0 and says why not."""
    monkeypatch.setattr(builder.EXTENSION, "load_error", lambda: "ninja is not installed (pip install ninja)")
    assert builder.main() == 0
    assert "NOT built (ninja is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(isa, kv_dtype):
    """Batch invariance, bit for bit: a speculative verification's rows (several query tokens of
    one sequence, in a batch with decode rows and a prefill chunk) equal decode calls made for
    each of those positions alone, and a decode row equals itself alone. Alone, a long context's
    parts run on different threads; in the batch, one after the other. Contexts that cross a
    part boundary within the chunk, head dims of the fast (64; 128, whose rows fill the AVX2
    registers: bf16 V rows widened once for many rows, few rows' widened per pass) and the
    general (80) path, sliding windows."""
    ext = builder.load()
    level = {"scalar": 0, "avx2": 1, "avx512": 2}[isa]
    c, ql = 507, 7  # positions 507..513 cross 512, a multiple of both part sizes
    spans = [(40, 1), (300, 1), (c, ql), (0, 9)]
    rows = [(40, 0), (300, 1)] + [(c + t, 2) for t in range(ql)]  # (context, sequence) of q's rows
    for head_dim, window, min_part in itertools.product((64, 80, 128), (0, 45), (32, 256)):
        q, _, _, kc, vc, meta, _ = paged_batch(spans, 2, 3, head_dim, 16, kv_dtype=kv_dtype)
        fixed = (0.125, window, None, None, level, min_part)
        batch = ext.paged_attention(
            q, kc, vc, meta.block_tables, meta.query_start_loc, meta.context_lens, *fixed
        )
        for i, (ctx, seq) in enumerate(rows):
            one = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
            alone = ext.paged_attention(
                q[i : i + 1].contiguous(), kc, vc, meta.block_tables[seq : seq + 1], *one, *fixed
            )
            assert torch.equal(alone[0], batch[i]), (head_dim, window, min_part, ctx)


def test_auto_follows_the_isa_cap_at_run_time(monkeypatch):
    """LMSTACK_MAX_ISA=avx2 (read on every call) on an AVX-512 CPU: the automatic path (isa -1)
    is the AVX2 one, bit for bit."""
    if BEST < 2:
        pytest.skip("this CPU has no AVX-512 to cap")
    ext = builder.load()
    q, _, _, kc, vc, meta, _ = paged_batch(
        [(0, 23), (40, 1), (300, 1)], 2, 3, 64, 16, kv_dtype=torch.bfloat16
    )
    args = (q, kc, vc, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.125, 0, None, None)
    monkeypatch.setenv("LMSTACK_MAX_ISA", "avx2")
    assert ext.best_isa() == 1
    assert torch.equal(ext.paged_attention(*args, -1, 256), ext.paged_attention(*args, 1, 256))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_queries_are_read_where_they_lie_in_the_fused_projection(q_dtype):
    """q as the fused qkv projection leaves it (a view whose tokens are a row of q, k and v heads
    apart) gives the bits of its contiguous copy, and the output is a fresh [T, Hq, D]; views the
    kernel cannot read in place (heads apart, a transposed q) are copied first, same bits."""
    ext = builder.load()
    q, _, _, kc, vc, meta, _ = paged_batch(
        [(0, 23), (40, 1), (300, 3)], 2, 3, 64, 16, kv_dtype=torch.bfloat16
    )
    q = q.to(q_dtype)
    t, hq, d = q.shape
    fused = torch.randn(t, hq + 2 * 2, d).to(q_dtype)
    fused[:, :hq] = q
    view = fused[:, :hq]
    assert not view.is_contiguous()
    fixed = (0.125, 0, None, None, -1, 256)
    rest = (kc, vc, meta.block_tables, meta.query_start_loc, meta.context_lens, *fixed)
    want = ext.paged_attention(q.contiguous(), *rest)
    got = ext.paged_attention(view, *rest)
    assert got.is_contiguous() and got.shape == (t, hq, d)
    assert torch.equal(got, want)
    spread = torch.zeros(t, hq, 2 * d, dtype=q_dtype)
    spread[:, :, :d] = q
    assert torch.equal(ext.paged_attention(spread[:, :, :d], *rest), want)
    assert torch.equal(ext.paged_attention(q.transpose(0, 1).contiguous().transpose(0, 1), *rest), want)
