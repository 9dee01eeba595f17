"""FlashAttention for varlen causal prefill over the paged KV cache, in Triton.

One program owns a tile of query rows of one sequence and one KV head. The rows are
(token, query head) pairs: `BLOCK_M // GROUP` consecutive tokens times the `GROUP` query heads
that share the KV head, so every K/V tile loaded from the cache serves the whole group (GQA).
It walks the keys the tile can see in `BLOCK_N`-token steps, reading them through the block
table — the chunk's own tokens were written to the cache by `write_kv`, so the cached context
and the new tokens are read the same way — and merges the steps with an online softmax
(running max `m` and sum `l`, the accumulator rescaled when `m` grows), so the scores exist
only as one [BLOCK_M, BLOCK_N] tile on chip. Accumulation is fp32; the output is stored in the
query dtype.

Keys strictly before the tile's first query position are visible to every row and need no
mask (stage 0); the rest of the causal range is masked (stage 1). With a sliding window every
step is masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lmstack.kernels.triton_support import enable_interpreter, next_pow2

# Head sizes the kernel takes; those that are not powers of two run padded to the next one.
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _softcap_log2(qk, softcap):
    """Base-2 scores s x log2(e) soft-capped: cap x tanh(s / cap), in base 2 again. That is
    c x tanh(qk / c) with c = cap x log2(e), and tanh(y) = 1 - 2 / (e^(2y) + 1), e^(2y) being
    2^(2 qk / cap): saturates to +-1 (no NaN) however large |qk| is."""
    c = softcap * 1.4426950408889634
    return c * (1.0 - 2.0 / (tl.exp2(qk * (2.0 / softcap)) + 1.0))


@triton.jit
def _prefill_kernel(
    Q,
    K_cache,
    V_cache,
    Out,
    block_tables,
    query_start_loc,
    seq_lens,
    K_scale,  # [Hkv] fp32: a scaled float8 cache holds K / K_scale, V / V_scale (HAS_KV_SCALE)
    V_scale,
    scale_log2,  # softmax scale * log2(e): scores are kept in base 2
    window,  # sliding window in tokens (read only with HAS_WINDOW)
    softcap,  # scores become softcap * tanh(score / softcap) (read only with HAS_SOFTCAP)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,  # K and V caches share one layout: [num_blocks, block_size, Hkv, D]
    stride_cs,
    stride_ch,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query rows per program: (BLOCK_M // GROUP) tokens x GROUP heads
    BLOCK_N: tl.constexpr,  # keys per step
    HAS_WINDOW: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (the interpreter's bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    if HAS_KV_SCALE:
        # One KV head per program, so its scales are scalars: K's folds into the score scale,
        # V's multiplies the output once; the tiles are only cast (float8 -> q's dtype).
        scale_log2 = scale_log2 * tl.load(K_scale + kv_head)
    TOKENS: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    tok0 = tile * TOKENS
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # cached tokens before this chunk

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + tok  # [BLOCK_M]

    first_pos = context + tok0
    last_pos = context + tl.minimum(tok0 + TOKENS, q_len) - 1
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        mid = lo  # every step masked
    else:
        lo = 0
        mid = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys < mid: visible to every row
    hi = last_pos + 1

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked step gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_d = kv_head * stride_ch + d * stride_cd  # [BLOCK_D] offsets within a token's slot

    for stage in tl.static_range(2):
        if stage == 0:
            start = lo
            end = mid
        else:
            start = mid
            end = hi
        for n0 in range(start, end, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            k_ok = kpos < seq_len
            block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv = (block * stride_cb + (kpos % BLOCK_SIZE) * stride_cs)[:, None] + head_d[None, :]
            if BLOCK_D == HEAD_DIM:
                kv_mask = k_ok[:, None]
            else:
                kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K_cache + kv, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
            v = tl.load(V_cache + kv, mask=kv_mask, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            if HAS_SOFTCAP:
                qk = _softcap_log2(qk, softcap)
            if stage == 1:
                visible = kpos[None, :] <= q_pos[:, None]
                if HAS_WINDOW:
                    visible = visible & (q_pos[:, None] - kpos[None, :] < window)
                qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if HAS_KV_SCALE:
        acc = acc * tl.load(V_scale + kv_head)
    tl.store(
        Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        acc.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _config(head_dim: int, max_query_len: int, group: int, interpret: bool) -> dict:
    """Tile sizes. On a GPU: 128 query rows x 64 keys (the FlashAttention-2 shape for head dim
    128 on Hopper), fewer rows for short queries (decode-like chunks), smaller tiles for head
    dims above 128 (shared memory). In the interpreter every op is one NumPy call on a whole
    tile, so far larger tiles (fewer programs and steps) run faster."""
    max_rows = INTERPRET_BLOCK_M if interpret else 128
    rows = min(max_rows, max(16, next_pow2(max_query_len * group)))
    rows = max(rows, next_pow2(group))  # at least one token per program
    if interpret:
        return {"BLOCK_M": rows, "BLOCK_N": INTERPRET_BLOCK_N}
    if head_dim > 128:
        return {"BLOCK_M": min(rows, 64), "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    warps = 8 if head_dim > 64 and rows >= 128 else 4
    return {"BLOCK_M": rows, "BLOCK_N": 64, "num_warps": warps, "num_stages": 3}


INTERPRET_BLOCK_M, INTERPRET_BLOCK_N = 512, 256


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, interpret: bool) -> None:
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash-attention: head dim {head_dim} is not supported (supported: {HEAD_DIMS})")
    if q.dtype not in DTYPES:
        raise ValueError(f"flash-attention: dtype {q.dtype} is not supported (supported: {DTYPES})")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"flash-attention: {q.shape[1]} query heads do not group over {k_cache.shape[2]} KV heads"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("flash-attention: the K and V caches must share one shape and layout")
    if interpret:
        enable_interpreter("flash-attention")  # already on, or a plain error saying how to turn it on
    elif q.device.type != "cuda":
        raise RuntimeError(
            f"flash-attention: tensors are on {q.device}; the kernel needs CUDA, or interpret=True "
            "(the Triton interpreter, for testing)"
        )


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    interpret: bool = False,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens to all its cached tokens.

    q [T, Hq, D] (sequence i's tokens at rows query_start_loc[i]..[i+1], at positions
    seq_lens[i] - query_len .. seq_lens[i] - 1); k_cache, v_cache [num_blocks, block_size, Hkv, D]
    already holding every position < seq_lens[i]; block_tables [B, max_blocks] int32.
    `max_query_len` comes from the host (no device sync). `config` overrides the tile sizes
    (BLOCK_M, BLOCK_N, num_warps, num_stages; for benchmarks). `k_scale`, `v_scale` ([Hkv]
    fp32): the caches hold K / k_scale and V / v_scale (a scaled float8 cache). `logit_softcap`:
    scores (after the scale) become cap x tanh(score / cap) before the mask (Gemma 2).
    Returns [T, Hq, D] in q's dtype."""
    check_inputs(q, k_cache, v_cache, interpret)
    t, hq, head_dim = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    cfg = {**_config(head_dim, max_query_len, group, interpret), **(config or {})}
    tokens_per_program = cfg["BLOCK_M"] // group
    grid = (triton.cdiv(max_query_len, tokens_per_program), batch, hkv)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        q if k_scale is None else k_scale,  # a placeholder pointer when unscaled (never read)
        q if v_scale is None else v_scale,
        scale * math.log2(math.e),
        sliding_window or 0,
        float(logit_softcap or 1.0),  # never read without HAS_SOFTCAP
        *q.stride(),
        *k_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        HAS_WINDOW=sliding_window is not None,
        HAS_KV_SCALE=k_scale is not None,
        HAS_SOFTCAP=bool(logit_softcap),
        UPCAST=interpret and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
    )
    return out
