"""`torch`: reference attention kernels over the paged KV cache, in plain PyTorch.

Correctness is the point: every other attention plugin is checked against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.registry import Component


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


class TorchAttention(AttentionBackend):
    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (ql, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)):
            s, e = starts[i], starts[i + 1]
            qi = q[s:e].transpose(0, 1)  # [Hq, ql, D]
            if ctx == 0 and sliding_window is None:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                oi = F.scaled_dot_product_attention(
                    qi, ki.to(q.dtype), vi.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                total = ctx + ql
                ki = gather_kv(k_cache, meta.block_tables[i], total).transpose(0, 1).to(q.dtype)
                vi = gather_kv(v_cache, meta.block_tables[i], total).transpose(0, 1).to(q.dtype)
                q_pos = torch.arange(ctx, total, device=q.device)
                k_pos = torch.arange(total, device=q.device)
                mask = causal_mask(q_pos, k_pos, sliding_window)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = oi.transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        memo = meta.scratch.get("torch.decode")
        if memo is None:  # the same for every layer of the step
            b = q.shape[0]
            block_size = k_cache.shape[1]
            n_blocks = (meta.max_seq_len + block_size - 1) // block_size
            tables = meta.block_tables[:, :n_blocks].long()
            length = n_blocks * block_size
            k_pos = torch.arange(length, device=q.device).expand(b, length)
            q_pos = (meta.seq_lens.long() - 1).view(b, 1)
            mask = causal_mask(q_pos, k_pos, sliding_window).unsqueeze(1)  # [B, 1, 1, L]
            if b == 1 and sliding_window is None:
                # One sequence: cut the gathered slots at its length instead of masking.
                mask, length = None, meta.seq_lens_cpu[0]
            memo = meta.scratch["torch.decode"] = (tables, mask, length)
        tables, mask, length = memo
        # [B, L, Hkv, D] -> [B, Hkv, L, D]
        keys = k_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2)
        values = v_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)


def build(options, ctx) -> TorchAttention:
    return TorchAttention()


COMPONENT = Component(
    name="torch",
    kind="attention",
    factory=build,
    description="Reference paged attention in plain PyTorch (SDPA per sequence for prefill, batched decode).",
    capabilities={
        "devices": ("cpu", "cuda", "mps"),
        "dtypes": ("float32", "float16", "bfloat16"),
        "kv_cache_dtypes": ("float32", "float16", "bfloat16"),
        "phases": ("prefill", "decode"),
        "sliding_window": True,
        "chunked_context": True,
    },
)
