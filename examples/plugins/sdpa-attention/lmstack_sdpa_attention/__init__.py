"""Example third-party lmstack plugin: attention kernel `sdpa`.

Prefill and decode over lmstack's paged KV cache through PyTorch's fused
`torch.nn.functional.scaled_dot_product_attention` (SDPA), which picks a flash, memory-efficient
or plain kernel for the device. What a kernel plugin has to do around the kernel call:

- read each sequence's keys and values out of the paged cache through its block table;
- build the causal mask of a query chunk that starts after `context_len` cached tokens (and of a
  sliding window);
- handle grouped-query attention (fewer KV heads than query heads): SDPA's `enable_gqa`, or
  repeating each KV head for its query group;
- declare in its capabilities exactly what it supports, which the core checks against the stack
  and the conformance kit tests.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch
import torch.nn.functional as F

from lmstack.batch import AttentionMetadata
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import AttentionBackend, BuildContext
from lmstack.registry import Component

__all__ = ["COMPONENT", "SdpaAttention", "SdpaOptions", "lmstack_register_attention"]


class SdpaOptions(msgspec.Struct, forbid_unknown_fields=True):
    # True: SDPA reads the KV heads as they are (`enable_gqa`, torch >= 2.5). False: repeat each
    # KV head for its query group first (a copy; what kernels without GQA support need).
    enable_gqa: Annotated[
        bool,
        msgspec.Meta(description="SDPA reads KV heads as they are (torch >= 2.5); false: repeat them first"),
    ] = True


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: cache [num_blocks, block_size, Hkv, D],
    block_table [max_blocks] -> [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., Lq, Lk] bool, True = attend: a query sees the keys at or before its own position, and
    with a window W only the last W of them (itself included)."""
    distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    mask = distance >= 0
    if sliding_window is not None:
        mask &= distance < sliding_window
    return mask


class SdpaAttention(AttentionBackend):
    def __init__(self, enable_gqa: bool = True) -> None:
        self.enable_gqa = enable_gqa

    def _sdpa(self, q, k, v, mask, *, scale, is_causal=False) -> torch.Tensor:
        """q [..., Hq, Lq, D]; k, v [..., Hkv, Lk, D] in q's dtype; mask broadcastable to
        [..., Hq, Lq, Lk] or None. Returns [..., Hq, Lq, D]."""
        group = q.shape[-3] // k.shape[-3]
        if group > 1 and not self.enable_gqa:
            k = k.repeat_interleave(group, dim=-3)
            v = v.repeat_interleave(group, dim=-3)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[-3] != q.shape[-3]
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        # q [T, Hq, D]; k, v [T, Hkv, D]: this step's tokens, also already written to the cache.
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (query_len, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            s, e = starts[i], starts[i] + query_len
            if context_len == 0:
                keys, values = k[s:e], v[s:e]  # a fresh prompt: nothing to read from the cache
            else:
                keys = gather_kv(k_cache, meta.block_tables[i], context_len + query_len)
                values = gather_kv(v_cache, meta.block_tables[i], context_len + query_len)
            keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
            if context_len == 0 and sliding_window is None:
                # Square causal attention: SDPA's own flag, no mask tensor. (Its causal mask is
                # aligned to the top-left corner, so it is wrong once there is cached context.)
                mask, causal = None, True
            else:
                q_pos = torch.arange(context_len, context_len + query_len, device=q.device)
                k_pos = torch.arange(context_len + query_len, device=q.device)
                mask, causal = allowed(q_pos, k_pos, sliding_window), False
            o = self._sdpa(q[s:e].transpose(0, 1), keys, values, mask, scale=scale, is_causal=causal)
            out[s:e] = o.transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window):
        # q [B, Hq, D]: one query per sequence, at position seq_len - 1. All sequences go through
        # one SDPA call, padded to the longest; the mask hides each one's padding.
        b, (block_size, hkv, d) = q.shape[0], k_cache.shape[1:]
        num_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :num_blocks].long().flatten()  # [B * num_blocks]
        length = num_blocks * block_size
        # Every sequence's blocks in table order: [B, length, Hkv, D] -> [B, Hkv, length, D]
        keys = k_cache.index_select(0, tables).view(b, length, hkv, d).transpose(1, 2).to(q.dtype)
        values = v_cache.index_select(0, tables).view(b, length, hkv, d).transpose(1, 2).to(q.dtype)
        q_pos = (meta.seq_lens.long() - 1).view(b, 1)  # [B, 1]
        k_pos = torch.arange(length, device=q.device).expand(b, length)
        mask = allowed(q_pos, k_pos, sliding_window).view(b, 1, 1, length)  # padding lies ahead of q_pos
        out = self._sdpa(q.unsqueeze(2), keys, values, mask, scale=scale)  # [B, Hq, 1, D]
        return out.squeeze(2)


def build(options: SdpaOptions, ctx: BuildContext) -> SdpaAttention:
    return SdpaAttention(enable_gqa=options.enable_gqa)


COMPONENT = Component(
    name="sdpa",
    kind="attention",
    factory=build,
    options_type=SdpaOptions,
    # Only what was tested (tests/ and the conformance kit): the CPU, three dtypes, both phases,
    # sliding windows, and prefill chunks over cached context (chunked prefill, speculative
    # verification). Every head size and block size works, so neither is restricted.
    capabilities={
        "devices": ("cpu",),
        "dtypes": ("float32", "float16", "bfloat16"),
        "kv_cache_dtypes": ("float32", "float16", "bfloat16"),
        "phases": ("prefill", "decode"),
        "sliding_window": True,
        "chunked_context": True,
    },
    description="Paged attention through torch's scaled_dot_product_attention (example plugin).",
    api=">=1.0,<2",
)


@hookimpl
def lmstack_register_attention(register) -> None:
    register(COMPONENT)
