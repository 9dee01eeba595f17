"""`torch`: reference attention kernels over the paged KV cache, in plain PyTorch.

Correctness is the point: every other attention plugin is checked against these. They are
still written for speed on a CPU: grouped-query matmuls (each KV head meets its whole query
group in one matmul, no K/V repetition) measured 2-6x faster than `scaled_dot_product_attention`
in bf16 here, and softmax runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.registry import Component

# Prefill chunks of at most this many query tokens (a speculative step's verification rows, the
# tail of a chunked prompt) are batched like decode: one gather and a few ops per group of equal
# chunk length, instead of ~15 ops per sequence and layer. Under 32 streams with n-gram drafts
# (bf16 on an Intel Xeon with AMX), the per-sequence loop was 40 % of the run and verification
# steps cost ~3x a decode step's per-token time.
SHORT_CHUNK = 16

# Query rows per score tile in prefill: bounds the [Hq, rows, context] fp32 score matrix.
_QUERY_TILE = 256


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    # index_select, not cache[table]: the advanced-indexing kernel was 4x slower for this copy.
    return cache.index_select(0, block_table[:n_blocks].long()).flatten(0, 1)[:length]


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., Lq, Lk] bool, True = attend. A query sees keys at or before its position, and with a
    window W only the last W of them (itself included)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


def softcap_(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """fp32 scores soft-capped in place, cap * tanh(scores / cap) (Gemma 2); as they are for None."""
    if cap:
        scores.div_(cap).tanh_().mul_(cap)
    return scores


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [..., Hkv, G*Lq, D] (query group folded into rows), k / v [..., Hkv, Lk, D],
    mask broadcastable to [..., Hkv, G*Lq, Lk] or None. Returns [..., Hkv, G*Lq, D]."""
    scores = softcap_(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v)


def _dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A gathered cache in `dtype`; a scaled float8 cache's values times `scale` (shaped to
    broadcast: one scale per KV head). (Folding the K scale into q instead would be cheaper but, in fp16, pushes
    the query into the subnormal range and the raw fp8 dot products past its max.)"""
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)  # one rounding, as `lmstack.quant.kv.dequantize_kv`


class TorchAttention(AttentionBackend):
    def prefill(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        *,
        scale,
        sliding_window,
        logit_softcap=None,
        k_scale=None,
        v_scale=None,
    ):
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        g = hq // hkv
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        short = self._short_chunks(meta)
        for ql, idx in short.items():
            self._short_group(
                q,
                out,
                k_cache,
                v_cache,
                meta,
                idx,
                ql,
                starts,
                (scale, logit_softcap),
                sliding_window,
                (k_scale, v_scale),
            )
        done = {i for idx in short.values() for i in idx}
        for i, (ql, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)):
            if i in done:
                continue
            s = starts[i]
            total = ctx + ql
            if ctx == 0 and k_scale is None:  # a scaled cache is read back, as stored
                ki, vi = k[s : s + ql], v[s : s + ql]
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], total)
                vi = gather_kv(v_cache, meta.block_tables[i], total)
            ki = _dequantize(ki, None if k_scale is None else k_scale.view(-1, 1), q.dtype)
            vi = _dequantize(vi, None if v_scale is None else v_scale.view(-1, 1), q.dtype)
            ki, vi = ki.permute(1, 0, 2), vi.permute(1, 0, 2)  # [Hkv, total, D]
            k_pos = torch.arange(total, device=q.device)
            for t0 in range(0, ql, _QUERY_TILE):
                t1 = min(ql, t0 + _QUERY_TILE)
                rows = t1 - t0
                # [rows, Hq, D] -> [Hkv, G*rows, D] with row index (g, t)
                qt = q[s + t0 : s + t1].view(rows, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * rows, d)
                # Keys past this tile's last position are never visible: cut them off.
                kend = ctx + t1
                q_pos = torch.arange(ctx + t0, kend, device=q.device)
                mask = causal_mask(q_pos, k_pos[:kend], sliding_window)  # [rows, kend]
                mask = mask.unsqueeze(0).expand(g, rows, kend).reshape(1, g * rows, kend)
                # [Hkv, G*rows, D]
                o = grouped_attention(qt, ki[:, :kend], vi[:, :kend], mask, scale, logit_softcap)
                out[s + t0 : s + t1] = o.view(hkv, g, rows, d).permute(2, 0, 1, 3).reshape(rows, hq, d)
        return out

    @staticmethod
    def _short_chunks(meta: AttentionMetadata) -> dict[int, list[int]]:
        """Sequences whose chunk has at most SHORT_CHUNK query tokens, by chunk length; only
        lengths shared by two or more sequences (one alone gains nothing from batching)."""
        by_len: dict[int, list[int]] = {}
        for i, ql in enumerate(meta.query_lens_cpu):
            if 0 < ql <= SHORT_CHUNK:
                by_len.setdefault(ql, []).append(i)
        return {ql: idx for ql, idx in by_len.items() if len(idx) > 1}

    @staticmethod
    def _short_group(q, out, k_cache, v_cache, meta, idx, ql, starts, scaling, window, kv_scales) -> None:
        """Prefill for sequences `idx`, each with `ql` query tokens after its context, at once:
        decode's block-diagonal formulation with ql query rows per sequence (the chunk's K / V
        are in the cache already). `scaling`: (scale, logit soft-cap or None)."""
        scale, softcap = scaling
        hq, d = q.shape[1], q.shape[2]
        hkv, bs = k_cache.shape[2], k_cache.shape[1]
        g, b = hq // hkv, len(idx)
        totals = [meta.context_lens_cpu[i] + ql for i in idx]
        n_blocks = -(-max(totals) // bs)
        length = n_blocks * bs
        rows = torch.tensor(idx, device=q.device)
        tables = meta.block_tables[rows, :n_blocks].long().reshape(-1)
        keys = k_cache.index_select(0, tables).view(b, length, hkv * d)
        values = v_cache.index_select(0, tables).view(b, length, hkv * d)
        if kv_scales[0] is not None:  # one scale per D-wide run of columns
            k_scale, v_scale = (sc.repeat_interleave(d) for sc in kv_scales)
            keys, values = _dequantize(keys, k_scale, q.dtype), _dequantize(values, v_scale, q.dtype)
        elif keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Query rows of these sequences, [b, ql, Hq, D] -> block-diagonal [b, ql*Hkv*G, Hkv*D].
        pos = torch.tensor([starts[i] for i in idx], device=q.device).view(b, 1) + torch.arange(
            ql, device=q.device
        )
        qs = q.index_select(0, pos.reshape(-1)).view(b, ql, hkv, g, 1, d)
        eye = torch.eye(hkv, dtype=q.dtype, device=q.device).view(1, 1, hkv, 1, hkv, 1)
        qb = (qs * eye).reshape(b, ql * hkv * g, hkv * d)
        scores = softcap_(torch.matmul(qb, keys.transpose(1, 2)).float() * scale, softcap)  # [b, ql*Hkv*G, L]
        q_pos = torch.tensor(totals, device=q.device).view(b, 1) - ql + torch.arange(ql, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = causal_mask(q_pos, k_pos.expand(b, length), window)  # [b, ql, L]
        mask = mask.view(b, ql, 1, length).expand(b, ql, hkv * g, length).reshape(b, ql * hkv * g, length)
        scores.masked_fill_(~mask, float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(values.dtype), values).view(b, ql, hkv, g, hkv, d)
        o = torch.diagonal(o, dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # [b, ql, Hkv, G, D]
        out.index_copy_(0, pos.reshape(-1), o.reshape(b * ql, hq, d))

    def decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        *,
        scale,
        sliding_window,
        logit_softcap=None,
        k_scale=None,
        v_scale=None,
    ):
        b, hq, d = q.shape
        hkv = k_cache.shape[2]
        g = hq // hkv
        kv_scales = (k_scale, v_scale)
        # The same for every layer of the step with this window (layers may differ in it: Gemma).
        groups = meta.scratch.get(("torch.decode", sliding_window))
        if groups is None:
            token_bytes = 2 * hkv * d * k_cache.element_size()  # K + V of one token
            groups = meta.scratch[("torch.decode", sliding_window)] = _decode_groups(
                meta, k_cache.shape[1], token_bytes, sliding_window, q.device
            )
        # Block-diagonal queries: row (h, g) carries q[h, g] in columns of head h and zeros
        # elsewhere, so one contiguous matmul against [L, Hkv*D] keys scores every head without
        # permuting the gathered cache (the permute copy cost more than the 3x extra FLOPs).
        eye = meta.scratch.get("torch.decode.eye")
        if eye is None:  # made once per step, not per layer
            eye = torch.eye(hkv, dtype=q.dtype, device=q.device).view(1, hkv, 1, hkv, 1)
            meta.scratch["torch.decode.eye"] = eye
        qb = (q.view(b, hkv, g, 1, d) * eye).reshape(b, hkv * g, hkv * d)
        scaling = (scale, logit_softcap)
        if len(groups) == 1:
            return self._decode_group(qb, k_cache, v_cache, groups[0], scaling, kv_scales).reshape(b, hq, d)
        out = torch.empty(b, hkv, g, d, dtype=q.dtype, device=q.device)
        for group in groups:
            out[group.rows] = self._decode_group(qb[group.rows], k_cache, v_cache, group, scaling, kv_scales)
        return out.reshape(b, hq, d)

    @staticmethod
    def _decode_group(qb, k_cache, v_cache, group, scaling, kv_scales=(None, None)) -> torch.Tensor:
        """qb [b, Hkv*G, Hkv*D] -> [b, Hkv, G, D] for one group of similar-length sequences;
        scaling: (scale, logit soft-cap or None)."""
        scale, softcap = scaling
        b, hkv, d = qb.shape[0], k_cache.shape[2], k_cache.shape[3]
        g = qb.shape[1] // hkv
        # index_select over the flattened tables: 4x faster than k_cache[tables] here (bf16,
        # 32 x 15 blocks: 60 vs 243 us), and this copy was a quarter of a batch-32 decode step.
        keys = k_cache.index_select(0, group.flat_tables).view(b, -1, hkv * d)[:, : group.length]
        values = v_cache.index_select(0, group.flat_tables).view(b, -1, hkv * d)[:, : group.length]
        if kv_scales[0] is not None:  # [b, L, Hkv*D]: one scale per D-wide run of columns
            k_scale, v_scale = (s.repeat_interleave(d) for s in kv_scales)
            keys, values = _dequantize(keys, k_scale, qb.dtype), _dequantize(values, v_scale, qb.dtype)
        elif keys.dtype != qb.dtype:
            keys, values = keys.to(qb.dtype), values.to(qb.dtype)
        scores = softcap_(torch.matmul(qb, keys.transpose(1, 2)).float() * scale, softcap)  # [b, Hkv*G, L]
        if group.mask is not None:
            scores.masked_fill_(~group.mask, float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(values.dtype), values).view(b, hkv, g, hkv, d)
        return torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2)  # [b, Hkv, G, D]


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # which batch rows
    tables: torch.Tensor  # [b, n_blocks] int64
    mask: torch.Tensor | None  # [b, 1, L] bool, True = attend
    length: int  # gathered slots used

    @property
    def flat_tables(self) -> torch.Tensor:  # [b * n_blocks], row-major
        return self.tables.view(-1)


# Gathering pads every sequence of a decode group to the group's longest, and each group costs
# a fixed run of ops. Groups are chosen to minimise padded bytes + a per-group cost worth this
# many bytes of gather (tuned on the offline benchmark here: 2^16..2^20 all land within noise
# of each other, far ahead of one padded group).
_GROUP_COST_BYTES = 1 << 18


def _split_by_length(lens: list[int], token_bytes: int) -> list[list[int]]:
    """Sequence indices grouped by length: exact DP over the sorted lengths (B is small)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    sl = [lens[i] for i in order]
    fixed = _GROUP_COST_BYTES / token_bytes  # in token slots
    best = [0.0] + [float("inf")] * len(sl)
    cut = [0] * (len(sl) + 1)
    for i in range(1, len(sl) + 1):
        for j in range(i):  # group = sorted[j:i], padded to its longest, sl[i - 1]
            cost = best[j] + fixed + sl[i - 1] * (i - j)
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(sl)
    while i > 0:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]


def _decode_groups(
    meta: AttentionMetadata, block_size: int, token_bytes: int, window: int | None, device
) -> list[_DecodeGroup]:
    lens = meta.seq_lens_cpu
    order = _split_by_length(lens, token_bytes) if len(lens) > 1 else [[0]]
    groups = []
    for idx in order:
        longest = max(lens[i] for i in idx)
        n_blocks = -(-longest // block_size)
        rows = slice(None) if len(order) == 1 else torch.tensor(idx, device=device)
        tables = meta.block_tables[rows, :n_blocks].long().contiguous()
        if len(idx) == 1 and window is None:
            # One sequence: cut the gathered slots at its length instead of masking.
            groups.append(_DecodeGroup(rows, tables, None, longest))
            continue
        length = n_blocks * block_size
        k_pos = torch.arange(length, device=device)
        q_pos = meta.seq_lens[rows].long().view(-1, 1) - 1
        mask = causal_mask(q_pos, k_pos.expand(len(idx), length), window)  # [b, 1, L]
        groups.append(_DecodeGroup(rows, tables, mask, length))
    return groups


def build(options, ctx) -> TorchAttention:
    return TorchAttention()


COMPONENT = Component(
    name="torch",
    kind="attention",
    factory=build,
    description="Reference paged attention in plain PyTorch (grouped-query matmuls, fp32 softmax).",
    capabilities={
        "devices": ("cpu", "cuda", "mps"),
        "dtypes": ("float32", "float16", "bfloat16"),
        "kv_cache_dtypes": ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
        "phases": ("prefill", "decode"),
        "sliding_window": True,
        "logit_softcap": True,
        "chunked_context": True,
    },
)
