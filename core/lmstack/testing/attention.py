"""Attention conformance: a backend's prefill and decode against a plain dense reference, on
fresh random inputs each run — odd lengths, several block sizes, GQA, cached context."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.quant.kv import FP8_KV_DTYPES, HEADROOM, dequantize_kv, quantize_kv

# The dense references, kept beside the kit and importable from here as they always were.
from lmstack.testing.attention_reference import (  # noqa: F401 (paged_batch: re-exported)
    paged_batch,
    plain_attention,
    reference_attention,
    rel_error,
)
from lmstack.testing.kit import ComponentKit


@dataclass(frozen=True)
class _Matrix:
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    block_sizes: tuple[int, ...]
    phases: tuple[str, ...]
    sliding_window: bool
    chunked_context: bool
    logit_softcap: bool


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8 = {str(d).removeprefix("torch."): d for d in FP8_KV_DTYPES}


def random_kv_scales(
    rng: random.Random, num_kv_heads: int, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, magnitudes) per head, as calibration would pick scales for heads of very different magnitudes:
    head h's values are ~N(0, mag_h^2), mag_h = 2^U(-4, 4); scale_h maps HEADROOM x mag_h x
    U(0.5, 2) (a calibration that over- or underestimated) to the format's max."""
    mags = [2.0 ** rng.uniform(-4, 4) for _ in range(num_kv_heads)]
    limit = torch.finfo(kv_dtype).max
    return torch.tensor([m * HEADROOM * rng.uniform(0.5, 2) / limit for m in mags]), torch.tensor(mags)


class AttentionConformance(ComponentKit):
    """Set `component` (a registered attention name or Component) and optionally `options`.

    The test matrix comes from the declared capabilities: `dtypes`, `head_dims`, `block_sizes`
    and `phases` (the kit's defaults where one is not declared), the cached-context prefill
    check when `chunked_context` is declared, the sliding-window checks (one window, and windows
    changing from layer to layer within a step) when `sliding_window` is, the soft-capping check
    when `logit_softcap` is.
    The class attributes of the same names may narrow the matrix (to keep interpreter-mode
    runs small); they must stay within what is declared, or the kit fails."""

    kind = "attention"

    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    phases: tuple[str, ...] | None = None  # the checks of a phase not listed are skipped
    sliding_window: bool | None = None  # False: skip the sliding-window check
    chunked_context: bool | None = None  # False: skip the cached-context prefill check
    logit_softcap: bool | None = None  # False: skip the soft-capping check
    kv_cache_dtypes: tuple[torch.dtype, ...] | None = None
    gqa_ratios: tuple[int, ...] = (1, 3, 8)
    num_kv_heads: int = 2
    max_len: int = 200
    large_decode_batch: int = 40
    device: str = "cpu"
    # A sequence passes when its relative error against the fp32 reference is at most
    # `reference_factor` x the error of `plain_attention` in the same dtype on the same inputs
    # and device, plus `slack[dtype]`. Measured (AVX2 CPU, random inputs as below): the torch
    # backend's bf16/fp16 error equals the plain computation's (ratio 1.00), the flash kernels'
    # is 0.77-1.14x it (they round at different points); 2x leaves room for that while a
    # kernel that keeps its running sums in the low dtype (no fp32 accumulation) exceeds it.
    # The slack covers sequences where the plain error is ~0 by chance (one or two keys):
    # a quarter of the dtype's epsilon. fp32 keeps an absolute 2e-5 (~170 ulp): every fp32
    # path accumulates in fp32, and reordering sums on any ISA moves results by a few ulp,
    # 1e-7 to 1e-6 measured.
    reference_factor: float = 2.0
    slack = {
        torch.float32: 2e-5,
        torch.float16: torch.finfo(torch.float16).eps / 4,
        torch.bfloat16: torch.finfo(torch.bfloat16).eps / 4,
    }
    # None: each check runs every combination of dtypes x head_dims x block_sizes x gqa_ratios.
    # A number: that many random combinations per check, fresh each run, in which every value
    # of every axis still appears (for slow backends, e.g. Triton kernels in the interpreter).
    cases: int | None = None

    # --- what to test, from the declared capabilities -------------------------------------------

    def backend(self) -> AttentionBackend:
        """The backend, built through the registered factory for the kit's device."""
        return self.build(device=self.device)

    def matrix(self) -> _Matrix:
        caps = self.capabilities()
        devices = caps.get("devices")
        if devices is not None and torch.device(self.device).type not in devices:
            pytest.skip(
                f"the backend declares devices {tuple(devices)}, not the kit's device {self.device!r}"
            )
        declared = caps.get("dtypes")
        declared_dtypes = None if declared is None else tuple(_DTYPES[n] for n in declared if n in _DTYPES)
        return _Matrix(
            dtypes=self.narrowed("dtypes", declared_dtypes, _DTYPES.values()),
            head_dims=self.narrowed("head_dims", caps.get("head_dims"), (64,)),
            block_sizes=self.narrowed("block_sizes", caps.get("block_sizes"), (1, 4, 16)),
            phases=self.narrowed("phases", caps.get("phases"), ("prefill", "decode")),
            sliding_window=self._flag("sliding_window", caps),
            chunked_context=self._flag("chunked_context", caps),
            logit_softcap=self._flag("logit_softcap", caps),
        )

    def _flag(self, name: str, caps: dict) -> bool:
        declared, chosen = bool(caps.get(name)), getattr(self, name)
        if chosen is None:
            return declared
        assert declared or not chosen, (
            f"{type(self).__name__}.{name} = True tests {name}, which the backend does not declare; "
            f"declare {name}: True or drop the attribute"
        )
        return chosen

    def test_class_attributes_within_declared_capabilities(self):
        """The narrowing attributes name only declared values (checked by `matrix()`)."""
        m = self.matrix()
        assert m.dtypes and m.head_dims and m.block_sizes and m.phases

    # --- building a random paged batch ---------------------------------------------------------

    def _batch(
        self, rng: random.Random, dtype, head_dim, block_size, ratio, spans, kv_dtype=None, scales=None
    ):
        """spans: [(context_len, query_len)] per sequence. Writes every token's K/V into a
        shuffled paged cache (in `kv_dtype`, default `dtype`); returns q, k_new, v_new, caches,
        metadata and the dense K/V (as stored, in `dtype`). `scales`: (k_scale, v_scale,
        magnitudes) of a scaled float8 cache (see `random_kv_scales`): head h's values are drawn
        at magnitude magnitudes[h] and stored divided by the scale; the dense K/V are the
        stored values times the scale."""
        kv_dtype = kv_dtype or dtype
        hkv, hq = self.num_kv_heads, self.num_kv_heads * ratio
        dev = self.device
        blocks_per_seq = [-(-(c + q) // block_size) for c, q in spans]
        num_blocks = sum(blocks_per_seq) + 3
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=dev).to(kv_dtype)  # garbage
        v_cache = torch.randn(k_cache.shape, device=dev).to(kv_dtype)
        tables, dense, qs, ks, vs = [], [], [], [], []
        for (c, ql), nb in zip(spans, blocks_per_seq, strict=True):
            table = [perm.pop() for _ in range(nb)]
            tables.append(table)
            if scales is None:
                k = torch.randn(c + ql, hkv, head_dim, device=dev).to(kv_dtype)
                v = torch.randn(c + ql, hkv, head_dim, device=dev).to(kv_dtype)
            else:
                k_scale, v_scale, mags = (t.to(dev) for t in scales)
                k = torch.randn(c + ql, hkv, head_dim, device=dev) * mags.view(-1, 1)
                v = torch.randn(c + ql, hkv, head_dim, device=dev) * mags.view(-1, 1)
                k, v = quantize_kv(k, k_scale, kv_dtype), quantize_kv(v, v_scale, kv_dtype)
            pos = torch.arange(c + ql, device=dev)  # every position into its (block, offset)
            blocks = torch.tensor(table, dtype=torch.long, device=dev)[pos // block_size]
            k_cache[blocks, pos % block_size] = k
            v_cache[blocks, pos % block_size] = v
            if scales is None:
                k, v = k.to(dtype), v.to(dtype)  # the stored values, as the model's dtype sees them
            else:
                k, v = dequantize_kv(k, k_scale, dtype), dequantize_kv(v, v_scale, dtype)
            dense.append((k, v))
            qs.append(torch.randn(ql, hq, head_dim, device=dev).to(dtype))
            ks.append(k[c:])
            vs.append(v[c:])
        meta = AttentionMetadata.build(
            [q for _, q in spans], [c for c, _ in spans], tables, block_size, device=dev
        )
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, dense, qs

    def _check(
        self, out, qs, dense, spans, scale, dtype, window=None, case=None, extra_slack=0.0, softcap=None
    ):
        assert out.shape == torch.cat(qs).shape
        assert torch.isfinite(out.float()).all()
        starts = [0]
        for _, ql in spans:
            starts.append(starts[-1] + ql)
        for i, ((c, _), (k, v)) in enumerate(zip(spans, dense, strict=True)):
            ref = reference_attention(qs[i], k, v, c, scale, window, softcap)
            err = rel_error(out[starts[i] : starts[i + 1]].cpu(), ref.cpu())
            plain = 0.0
            if dtype != torch.float32:
                plain = rel_error(plain_attention(qs[i], k, v, c, scale, window, softcap).cpu(), ref.cpu())
            bound = self.reference_factor * plain + self.slack[dtype] + extra_slack
            where = "" if case is None else "{} head_dim {} block_size {} gqa {}: ".format(*case)
            assert err <= bound, (
                f"{where}seq {i} (context {c}, query {qs[i].shape[0]}): rel error {err:.2e} > "
                f"{self.reference_factor} x plain {dtype} attention's {plain:.2e} + {self.slack[dtype] + extra_slack:.1e}"
            )

    def _cases(self, m: _Matrix):
        axes = (m.dtypes, m.head_dims, m.block_sizes, self.gqa_ratios)
        if self.cases is None:
            yield from itertools.product(*axes)
            return
        rng = random.Random()
        n = max(self.cases, *(len(axis) for axis in axes))
        columns = []
        for axis in axes:  # each axis: shuffled passes over its values, so none is left out
            column: list = []
            while len(column) < n:
                column += rng.sample(list(axis), len(axis))
            columns.append(column[:n])
        yield from zip(*columns)

    def _needs(self, phase: str) -> _Matrix:
        m = self.matrix()
        if phase not in m.phases:
            pytest.skip(f"backend declares no {phase} phase")
        return m

    # --- the checks --------------------------------------------------------------------------------

    def test_prefill_varlen(self):
        m, backend = self._needs("prefill"), self.backend()
        rng = random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            spans = [(0, rng.randint(1, self.max_len)) for _ in range(3)] + [(0, 1)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, case=(dtype, hd, bs, ratio))

    def test_prefill_chunk_attends_to_cached_context(self):
        m, backend = self._needs("prefill"), self.backend()
        if not m.chunked_context:
            pytest.skip("backend declares no chunked_context (prefill over cached tokens)")
        rng = random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            spans = [(rng.randint(1, self.max_len), rng.randint(1, self.max_len // 2)) for _ in range(3)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, case=(dtype, hd, bs, ratio))

    def test_prefill_verification_shaped_chunks(self):
        """Speculative decoding's verification: many sequences with cached context, each with a
        few query tokens (several sharing a length, as equal draft lengths do), beside one long
        chunk; every case, and under a sliding window where declared."""
        m, backend = self._needs("prefill"), self.backend()
        if not m.chunked_context:
            pytest.skip("backend declares no chunked_context (prefill over cached tokens)")
        rng = random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            lens = [rng.randint(1, 5) for _ in range(3)]
            spans = [(rng.randint(1, self.max_len), lens[i % 3]) for i in range(7)]
            spans.insert(rng.randint(0, 7), (rng.randint(0, self.max_len // 2), rng.randint(17, 40)))
            windows = [None] + ([rng.randint(2, 12)] if m.sliding_window else [])
            for window in windows:
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
                out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=window)
                self._check(out, qs, dense, spans, hd**-0.5, dtype, window, case=(dtype, hd, bs, ratio))

    def test_decode(self):
        m, backend = self._needs("decode"), self.backend()
        rng = random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            spans = [(rng.randint(0, self.max_len), 1) for _ in range(5)] + [(0, 1)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, case=(dtype, hd, bs, ratio))

    def test_decode_large_batch(self):
        """Many sequences of mixed lengths in one decode batch (backends may group or split them)."""
        m, backend = self._needs("decode"), self.backend()
        rng = random.Random()
        dtype, hd, bs = m.dtypes[0], m.head_dims[0], m.block_sizes[-1]
        for ratio in self.gqa_ratios:
            spans = [(rng.randint(0, self.max_len), 1) for _ in range(self.large_decode_batch)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, case=(dtype, hd, bs, ratio))

    def test_decode_single_sequence(self):
        m, backend = self._needs("decode"), self.backend()
        rng = random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            spans = [(rng.randint(0, self.max_len), 1)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, case=(dtype, hd, bs, ratio))

    def test_sliding_window(self):
        m = self.matrix()
        if not m.sliding_window:
            pytest.skip("backend declares no sliding-window support")
        backend = self.backend()
        rng = random.Random()
        dtype = torch.float32 if torch.float32 in m.dtypes else m.dtypes[0]
        hd, bs, ratio = m.head_dims[0], m.block_sizes[-1], self.gqa_ratios[-1]
        window = rng.randint(3, 40)
        if "prefill" in m.phases:
            spans = [(rng.randint(1, self.max_len), rng.randint(2, 30)), (0, rng.randint(2, 60))]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=window)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, window)
        if "decode" in m.phases:
            spans = [(rng.randint(0, self.max_len), 1) for _ in range(4)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=window)
            self._check(out, qs, dense, spans, hd**-0.5, dtype, window)

    def test_windows_change_from_layer_to_layer(self):
        """One step's metadata through "layers" of different windows, as the model runner calls
        a model whose layers alternate local and global attention (Gemma 2 / 3): global, a
        window, another window, global again, prefill and decode. A backend that derives
        something from the window once per step and reuses it for the next layer fails."""
        m = self.matrix()
        if not m.sliding_window:
            pytest.skip("backend declares no sliding-window support")
        backend, rng = self.backend(), random.Random()
        dtype = torch.float32 if torch.float32 in m.dtypes else m.dtypes[0]
        hd, bs, ratio = m.head_dims[0], m.block_sizes[-1], self.gqa_ratios[-1]
        small, large = rng.randint(2, 12), rng.randint(20, 60)
        windows = [None, small, large, None, small]
        if "prefill" in m.phases:
            context = (lambda: rng.randint(1, self.max_len)) if m.chunked_context else (lambda: 0)
            spans = [(context(), rng.randint(2, 40)), (0, rng.randint(2, 70)), (context(), 3), (context(), 3)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            for window in windows:
                out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=window)
                self._check(
                    out, qs, dense, spans, hd**-0.5, dtype, window, case=(f"window {window}", hd, bs, ratio)
                )
        if "decode" in m.phases:
            spans = [(rng.randint(0, self.max_len), 1) for _ in range(5)]
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
            for window in windows:
                out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=window)
                self._check(
                    out, qs, dense, spans, hd**-0.5, dtype, window, case=(f"window {window}", hd, bs, ratio)
                )

    def test_logit_softcap(self):
        """Soft-capped scores (Gemma 2: cap * tanh(score / cap), here with caps of a few units and
        a scale of 1 so that the cap bends most scores), with and without a sliding window,
        prefill (over cached context when declared, and short chunks of equal length as
        verification makes) and decode, every case of the matrix. The capped reference differs
        from the uncapped one by far more than the bound, so a kernel that ignores the cap fails."""
        m = self.matrix()
        if not m.logit_softcap:
            pytest.skip("backend declares no logit_softcap")
        backend, rng = self.backend(), random.Random()
        for dtype, hd, bs, ratio in self._cases(m):
            cap, scale = rng.uniform(1.0, 4.0), rng.uniform(0.5, 1.0)
            window = rng.choice([None, rng.randint(3, 30)]) if m.sliding_window else None
            case = (f"{dtype}, softcap {cap:.2f}, window {window}", hd, bs, ratio)
            kw = {"scale": scale, "sliding_window": window, "logit_softcap": cap}
            if "prefill" in m.phases:
                context = (lambda: rng.randint(1, self.max_len // 2)) if m.chunked_context else (lambda: 0)
                spans = [
                    (context(), rng.randint(1, 40)),
                    (0, rng.randint(20, 60)),  # enough rows with several keys: see below
                    (context(), 2),
                    (context(), 2),
                ]
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
                out = backend.prefill(q, k, v, kc, vc, meta, **kw)
                self._check(out, qs, dense, spans, scale, dtype, window, case=case, softcap=cap)
                # The cap matters: over 20+ rows (a first row sees itself alone, whatever the
                # cap), the uncapped result is far off.
                c, _ = spans[1]
                uncapped = reference_attention(qs[1], *dense[1], c, scale, window)
                assert (
                    rel_error(uncapped, reference_attention(qs[1], *dense[1], c, scale, window, cap)) > 0.05
                )
            if "decode" in m.phases:
                spans = [(rng.randint(0, self.max_len), 1) for _ in range(4)]
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans)
                out = backend.decode(q, kc, vc, meta, **kw)
                self._check(out, qs, dense, spans, scale, dtype, window, case=case, softcap=cap)

    def test_kv_cache_in_declared_dtypes(self):
        """Caches stored in each declared `kv_cache_dtypes` entry other than the query's dtype
        (a quantizer may keep an fp16 KV cache under an fp32 model). The reference sees the
        same stored values, so only the query dtype's arithmetic error is allowed."""
        m = self.matrix()
        declared = self.capabilities().get("kv_cache_dtypes")
        declared_dtypes = None if declared is None else tuple(_DTYPES[n] for n in declared if n in _DTYPES)
        dtype = torch.float32 if torch.float32 in m.dtypes else m.dtypes[0]
        others = [d for d in self.narrowed("kv_cache_dtypes", declared_dtypes, ()) if d != dtype]
        if not others:
            pytest.skip(f"the backend declares no KV-cache dtype other than {dtype}")
        backend, rng = self.backend(), random.Random()
        hd, bs, ratio = m.head_dims[0], m.block_sizes[-1], self.gqa_ratios[-1]
        for kv_dtype in others:
            case = (f"{dtype} over a {kv_dtype} cache", hd, bs, ratio)
            if "prefill" in m.phases:
                context = (lambda: rng.randint(1, self.max_len // 2)) if m.chunked_context else (lambda: 0)
                spans = [(context(), rng.randint(1, 20)) for _ in range(2)]
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans, kv_dtype)
                out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
                self._check(out, qs, dense, spans, hd**-0.5, dtype, case=case)
            if "decode" in m.phases:
                spans = [(rng.randint(0, self.max_len), 1) for _ in range(3)]
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, ratio, spans, kv_dtype)
                out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=None)
                self._check(out, qs, dense, spans, hd**-0.5, dtype, case=case)

    def test_scaled_fp8_kv_cache(self):
        """Each declared float8 KV dtype, stored scaled per KV head (k_scale / v_scale passed as
        the model runner passes them): prefill (over cached context when declared) and decode
        on fresh random odd-length batches, every GQA ratio, against the reference over the
        dequantized cache. Heads differ in magnitude by up to 2^8, so a scale applied to the
        wrong head fails."""
        m = self.matrix()
        declared = [_FP8[n] for n in self.capabilities().get("kv_cache_dtypes", ()) if n in _FP8]
        fp8 = [d for d in declared if self.kv_cache_dtypes is None or d in self.kv_cache_dtypes]
        if not fp8:
            pytest.skip("the backend declares no float8 KV-cache dtype")
        backend, rng = self.backend(), random.Random()
        combos = list(itertools.product(fp8, self.gqa_ratios, m.dtypes))
        if self.cases is not None:  # a slow backend: every value of each axis at least once
            axes = [
                fp8,
                rng.sample(list(self.gqa_ratios), len(self.gqa_ratios)),
                rng.sample(m.dtypes, len(m.dtypes)),
            ]
            n = max(len(a) for a in axes)
            combos = [tuple(a[i % len(a)] for a in axes) for i in range(n)]
        for kv_dtype, ratio, dtype in combos:
            hd, bs = rng.choice(m.head_dims), rng.choice(m.block_sizes)
            case = (f"{dtype} over a scaled {kv_dtype} cache", hd, bs, ratio)
            # Dequantizing (code x scale) may round once more in the kernel than in the
            # reference (e.g. the product formed in the low dtype): with few keys the plain
            # error is ~0, so allow three epsilons of the model dtype on top. A key rounded by
            # eps/2 moves its score by up to |score| * eps/2, which the softmax passes on as
            # relative error in the weights; scores of a few units make that a few eps
            # (measured: a single-key bf16 decode 0.6 eps; fp16 over e5m2, 21 keys, 2.7 eps).
            # A wrong or missing scale is off by tens of percent, far outside either bound.
            extra = 3 * torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
            k_scale, mags = random_kv_scales(rng, self.num_kv_heads, kv_dtype)
            v_scale = k_scale * rng.uniform(0.5, 2)
            scales = (k_scale, v_scale, mags)
            kw = {"k_scale": k_scale.to(self.device), "v_scale": v_scale.to(self.device)}
            if "prefill" in m.phases:
                context = (lambda: rng.randint(1, self.max_len // 2)) if m.chunked_context else (lambda: 0)
                # Two chunks of one short length too: what a speculative step verifies.
                spans = [
                    (context(), rng.randint(1, 40)),
                    (0, rng.randint(1, 40)),
                    (context(), 3),
                    (context(), 3),
                ]
                q, k, v, kc, vc, meta, dense, qs = self._batch(
                    rng, dtype, hd, bs, ratio, spans, kv_dtype, scales
                )
                out = backend.prefill(q, k, v, kc, vc, meta, scale=hd**-0.5, sliding_window=None, **kw)
                self._check(out, qs, dense, spans, hd**-0.5, dtype, case=case, extra_slack=extra)
            if "decode" in m.phases:
                spans = [(rng.randint(0, self.max_len), 1) for _ in range(3)]
                q, k, v, kc, vc, meta, dense, qs = self._batch(
                    rng, dtype, hd, bs, ratio, spans, kv_dtype, scales
                )
                out = backend.decode(q, kc, vc, meta, scale=hd**-0.5, sliding_window=None, **kw)
                self._check(out, qs, dense, spans, hd**-0.5, dtype, case=case, extra_slack=extra)

    def test_write_kv_scaled_fp8(self):
        """write_kv with scales stores value / scale per head, clamped to the format's range."""
        m, backend = self.matrix(), self.backend()
        declared = [_FP8[n] for n in self.capabilities().get("kv_cache_dtypes", ()) if n in _FP8]
        if not declared:
            pytest.skip("the backend declares no float8 KV-cache dtype")
        rng = random.Random()
        hd, bs = m.head_dims[0], m.block_sizes[-1]
        spans = [(rng.randint(0, 40), rng.randint(1, 20)) for _ in range(3)]
        for kv_dtype in declared:
            q, k, v, kc, vc, meta, dense, qs = self._batch(rng, torch.float32, hd, bs, 1, spans)
            k_scale, _ = random_kv_scales(rng, self.num_kv_heads, kv_dtype)
            v_scale = k_scale * 3
            k = k * 1e4  # far past HEADROOM: must saturate, not turn into NaN
            kc8, vc8 = torch.zeros_like(kc, dtype=kv_dtype), torch.zeros_like(vc, dtype=kv_dtype)
            backend.write_kv(
                k,
                v,
                kc8,
                vc8,
                meta.slot_mapping,
                k_scale=k_scale.to(kc.device),
                v_scale=v_scale.to(kc.device),
            )
            stored_k = kc8.view(-1, *kc8.shape[2:])[meta.slot_mapping].float()
            stored_v = vc8.view(-1, *vc8.shape[2:])[meta.slot_mapping].float()
            assert torch.isfinite(stored_k).all()
            assert torch.equal(stored_k, quantize_kv(k, k_scale.to(k.device), kv_dtype).float())
            assert torch.equal(stored_v, quantize_kv(v, v_scale.to(v.device), kv_dtype).float())

    def test_write_kv_uses_slot_mapping(self):
        """Each token's K/V rows land in its slot, in every declared dtype, also when k and v
        are strided views (as a model's fused QKV projection gives them); nothing else moves."""
        m, backend = self.matrix(), self.backend()
        rng = random.Random()
        hd, bs = m.head_dims[0], m.block_sizes[-1]
        spans = [(rng.randint(0, 40), rng.randint(1, 20)) for _ in range(3)]
        declared = self.capabilities().get("kv_cache_dtypes")
        cache_dtypes = [] if declared is None else [_DTYPES[n] for n in declared if n in _DTYPES]
        for dtype in m.dtypes:
            for cache_dtype in dict.fromkeys([dtype, *cache_dtypes]):
                q, k, v, kc, vc, meta, dense, qs = self._batch(rng, dtype, hd, bs, 1, spans)
                fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
                kv_at = q[0].numel()
                k_view = fused[:, kv_at : kv_at + k[0].numel()].view_as(k)
                v_view = fused[:, kv_at + k[0].numel() :].view_as(v)
                kc2 = torch.full(kc.shape, 7.0, dtype=cache_dtype, device=kc.device)
                vc2 = torch.full(vc.shape, 7.0, dtype=cache_dtype, device=vc.device)
                expect_k, expect_v = kc2.clone(), vc2.clone()
                backend.write_kv(k_view, v_view, kc2, vc2, meta.slot_mapping)
                expect_k.view(-1, *kc.shape[2:])[meta.slot_mapping] = k.to(cache_dtype)
                expect_v.view(-1, *vc.shape[2:])[meta.slot_mapping] = v.to(cache_dtype)
                what = f"after write_kv of {dtype} rows into a {cache_dtype} cache"
                assert torch.equal(kc2, expect_k), f"K cache {what}"
                assert torch.equal(vc2, expect_v), f"V cache {what}"
