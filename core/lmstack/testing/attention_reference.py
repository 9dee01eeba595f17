"""Dense attention references for the attention kit and for kernel tests: the exact fp32
reference, the plain computation in a low dtype (what that dtype's arithmetic costs), a random
paged batch, and the relative error between two outputs."""

from __future__ import annotations

import random

import torch

from lmstack.batch import AttentionMetadata


def _allowed(
    lq: int, lk: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[Lq, Lk] bool: causal (queries sit at positions context_len..), within the window."""
    qpos = torch.arange(context_len, context_len + lq, device=device)[:, None]
    kpos = torch.arange(lk, device=device)[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed &= qpos - kpos < sliding_window
    return allowed


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else cap * torch.tanh(scores / cap)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One sequence, dense, fp32. q [Lq, Hq, D] at positions context_len.. ; k, v [L, Hkv, D]
    for positions 0..L-1. `softcap`: scores (after the scale) become softcap * tanh(score /
    softcap) before the mask (Gemma 2's attention soft-capping). Returns [Lq, Hq, D]."""
    lq, hq, _ = q.shape
    hkv = k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    vv = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = _softcap(torch.einsum("qhd,khd->hqk", q.float(), kk) * scale, softcap)
    scores = scores.masked_fill(
        ~_allowed(lq, k.shape[0], context_len, sliding_window, q.device), float("-inf")
    )
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same dense attention as `reference_attention`, computed the plain way in q's dtype on
    q's device: score and output matmuls in that dtype, softmax in fp32, probabilities rounded
    to that dtype (as the torch backend and the flash kernels do). Its error against
    `reference_attention` is what arithmetic in that dtype costs on this machine: low-precision
    matmuls round differently on different CPUs (native bf16 dot products or emulation) and
    GPUs, so a backend's fp16/bf16 error is judged against this, measured on the same inputs."""
    lq, hq, _ = q.shape
    hkv = k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    scores = _softcap(torch.einsum("qhd,khd->hqk", q, kk).float() * scale, softcap)
    scores = scores.masked_fill(
        ~_allowed(lq, k.shape[0], context_len, sliding_window, q.device), float("-inf")
    )
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1).to(q.dtype), vv)


def paged_batch(
    spans: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    seed: int | None = None,
):
    """A random paged batch outside the kit (kernel tests, benchmarks): spans [(context_len,
    query_len)] per sequence, every token's K/V written into a cache (in `kv_dtype`, default
    `dtype`) whose blocks are shuffled, as a long-running allocator leaves them. Returns
    (q [T, Hq, D], k, v [T, Hkv, D] (this step's tokens), k_cache, v_cache, metadata, dense), where
    dense[i] is sequence i's (k, v) over all its positions as stored, in `dtype`."""
    gen = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    kv_dtype = kv_dtype or dtype
    blocks = [-(-(c + q) // block_size) for c, q in spans]
    order = torch.randperm(sum(blocks) + 2, generator=gen).tolist()  # 2 blocks nobody owns
    shape = (len(order), block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    tables = [[order.pop() for _ in range(n)] for n in blocks]
    meta = AttentionMetadata.build([q for _, q in spans], [c for c, _ in spans], tables, block_size)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    dense = []
    for table, (c, q) in zip(tables, spans, strict=True):
        pos = torch.arange(c + q)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        dense.append((flat_k[slots].to(dtype), flat_v[slots].to(dtype)))
    q = torch.randn(sum(q for _, q in spans), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k, v = flat_k[meta.slot_mapping].to(dtype), flat_v[meta.slot_mapping].to(dtype)
    return q, k, v, k_cache, v_cache, meta, dense


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))
