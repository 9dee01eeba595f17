"""`torch`: reference attention kernels over the paged KV cache, in plain PyTorch.

Correctness is the point: every other attention plugin is checked against these. They are
still written for speed on a CPU: grouped-query matmuls (each KV head meets its whole query
group in one matmul, no K/V repetition) measured 2-6x faster than `scaled_dot_product_attention`
in bf16 here, and softmax runs in fp32.
"""

from __future__ import annotations

import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.registry import Component

# Query rows per score tile in prefill: bounds the [Hq, rows, context] fp32 score matrix.
_QUERY_TILE = 256


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., Lq, Lk] bool, True = attend. A query sees keys at or before its position, and with a
    window W only the last W of them (itself included)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [..., Hkv, G*Lq, D] (query group folded into rows), k / v [..., Hkv, Lk, D],
    mask broadcastable to [..., Hkv, G*Lq, Lk] or None. Returns [..., Hkv, G*Lq, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v)


class TorchAttention(AttentionBackend):
    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        g = hq // hkv
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (ql, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)):
            s = starts[i]
            total = ctx + ql
            if ctx == 0:
                ki, vi = k[s : s + ql], v[s : s + ql]
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], total)
                vi = gather_kv(v_cache, meta.block_tables[i], total)
            ki = ki.to(q.dtype).permute(1, 0, 2)  # [Hkv, total, D]
            vi = vi.to(q.dtype).permute(1, 0, 2)
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
                o = grouped_attention(qt, ki[:, :kend], vi[:, :kend], mask, scale)  # [Hkv, G*rows, D]
                out[s + t0 : s + t1] = o.view(hkv, g, rows, d).permute(2, 0, 1, 3).reshape(rows, hq, d)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        b, hq, d = q.shape
        hkv = k_cache.shape[2]
        memo = meta.scratch.get("torch.decode")
        if memo is None:  # the same for every layer of the step
            block_size = k_cache.shape[1]
            n_blocks = (meta.max_seq_len + block_size - 1) // block_size
            tables = meta.block_tables[:, :n_blocks].long()
            length = n_blocks * block_size
            if b == 1 and sliding_window is None:
                # One sequence: cut the gathered slots at its length instead of masking.
                mask, length = None, meta.seq_lens_cpu[0]
            else:
                k_pos = torch.arange(length, device=q.device).expand(b, length)
                q_pos = (meta.seq_lens.long() - 1).view(b, 1)
                mask = causal_mask(q_pos, k_pos, sliding_window).view(b, 1, 1, length)
            memo = meta.scratch["torch.decode"] = (tables, mask, length)
        tables, mask, length = memo
        # [B, L, Hkv, D] -> [B, Hkv, L, D], made contiguous: CPU batched matmuls over strided
        # operands measured 2x slower than the extra copy.
        keys = k_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2).contiguous().to(q.dtype)
        values = v_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2).contiguous().to(q.dtype)
        out = grouped_attention(q.view(b, hkv, hq // hkv, d), keys, values, mask, scale)
        return out.reshape(b, hq, d)


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
        "kv_cache_dtypes": ("float32", "float16", "bfloat16"),
        "phases": ("prefill", "decode"),
        "sliding_window": True,
        "chunked_context": True,
    },
)
