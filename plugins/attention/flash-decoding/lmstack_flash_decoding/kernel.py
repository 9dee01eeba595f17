"""FlashDecoding over the paged KV cache, in Triton: split-KV decode plus a log-sum-exp merge.

Decode has one query token per sequence, so one program per (sequence, KV head) leaves most of
a GPU idle when the batch is small. Here each sequence's key range is cut into `num_splits`
chunks, one program per (sequence, KV head, chunk):

- `_split_kernel` walks its chunk `BLOCK_N` keys at a time through the block table. The query
  rows are the `GROUP` query heads sharing the KV head (padded to ≥ 16 rows for `tl.dot`), so
  each K/V tile is loaded once for the whole group. It writes the chunk's normalised partial
  output and its log-sum-exp (base 2).
- `_merge_kernel` combines a sequence's chunks: out = Σ_s 2^(lse_s − M) o_s / Σ_s 2^(lse_s − M).

With one split the first kernel writes the final output directly and the merge is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmstack.kernels.triton_support import enable_interpreter, next_pow2

HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SPLITS = 128


@triton.jit
def _softcap_log2(qk, softcap):
    """Base-2 scores s x log2(e) soft-capped: cap x tanh(s / cap), in base 2 again. That is
    c x tanh(qk / c) with c = cap x log2(e), and tanh(y) = 1 - 2 / (e^(2y) + 1), e^(2y) being
    2^(2 qk / cap): saturates to +-1 (no NaN) however large |qk| is."""
    c = softcap * 1.4426950408889634
    return c * (1.0 - 2.0 / (tl.exp2(qk * (2.0 / softcap)) + 1.0))


@triton.jit
def _split_kernel(
    Q,
    K_cache,
    V_cache,
    block_tables,
    seq_lens,
    Out,  # [B, Hq, S, D] fp32 partials, or the final [B, Hq, D] output when S == 1 (stride_os 0)
    Lse,  # [B, Hq, S] fp32 (unused when S == 1)
    K_scale,  # [Hkv] fp32: a scaled float8 cache holds K / K_scale, V / V_scale (HAS_KV_SCALE)
    V_scale,
    scale_log2,
    window,
    softcap,  # scores become softcap * tanh(score / softcap) (read only with HAS_SOFTCAP)
    chunk,  # keys per split, a multiple of BLOCK_N
    stride_qb,
    stride_qh,
    stride_qd,
    stride_cb,  # K and V caches share one layout: [num_blocks, block_size, Hkv, D]
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_KV_SCALE:
        # One KV head per program: K's scale folds into the score scale, V's multiplies the
        # (normalised) partial output, which the merge combines linearly.
        scale_log2 = scale_log2 * tl.load(K_scale + kv_head)

    seq_len = tl.load(seq_lens + seq)
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_d = kv_head * stride_ch + d * stride_cd  # [BLOCK_D] offsets within a token's slot
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv = (block * stride_cb + (kpos % BLOCK_SIZE) * stride_cs)[:, None] + head_d[None, :]
        if BLOCK_D == HEAD_DIM:
            kv_mask = k_ok[:, None]
        else:
            kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + kv, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(V_cache + kv, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        if HAS_SOFTCAP:
            qk = _softcap_log2(qk, softcap)
        qk = tl.where(k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (past a short sequence's end) leaves l = 0: lse = -inf, weight 0 in the merge.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if HAS_KV_SCALE:
        acc = acc * tl.load(V_scale + kv_head)
    rows = seq.to(tl.int64) * stride_ob + head * stride_oh + split * stride_os
    tl.store(
        Out + rows[:, None] + d[None, :] * stride_od,
        acc.to(Out.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + seq * stride_lb + head * stride_lh + split * stride_ls, lse, mask=g_ok)


@triton.jit
def _merge_kernel(
    Partial,  # [B, Hq, S, D] fp32
    Lse,  # [B, Hq, S] fp32
    Out,  # [B, Hq, D]
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(Lse + seq * stride_lb + head * stride_lh + s * stride_ls, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    parts = tl.load(
        Partial
        + seq.to(tl.int64) * stride_pb
        + head * stride_ph
        + s[:, None] * stride_ps
        + d[None, :] * stride_pd,
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        Out + seq.to(tl.int64) * stride_ob + head * stride_oh + d * stride_od,
        out.to(Out.dtype.element_ty),
        mask=d_ok,
    )


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int
    chunk: int  # keys per split


def num_sms(device: torch.device, interpret: bool) -> int:
    """Streaming multiprocessors to fill; the interpreter pretends to have 4 (small and fixed,
    so tests see the same splits on every machine)."""
    if interpret or device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}


def _cuda_sms(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def plan_splits(
    batch: int,
    kv_heads: int,
    max_keys: int,
    sms: int,
    block_n: int,
    *,
    min_chunk: int,
    waves: int = 4,
    num_splits: int | None = None,
) -> SplitPlan:
    """How many chunks to cut each sequence's keys into.

    Enough programs for `waves` per SM (decode is memory-bound: more resident programs hide
    latency), but no chunk shorter than `min_chunk` keys (each split costs a partial write and a
    share of the merge) and never more than MAX_SPLITS. Batches that fill the device already get
    one split, i.e. no merge. `num_splits` overrides the choice (benchmarks, tests)."""
    max_keys = max(1, max_keys)
    if num_splits is None:
        wanted = triton.cdiv(waves * sms, max(1, batch * kv_heads))
        by_length = triton.cdiv(max_keys, min_chunk)
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    num_splits = max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max_keys, block_n)))
    chunk = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    return SplitPlan(num_splits=triton.cdiv(max_keys, chunk), chunk=chunk)


def choose_splits(
    batch: int,
    kv_heads: int,
    max_keys: int,
    device: torch.device,
    interpret: bool,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> SplitPlan:
    """The split plan `flash_decode` uses for this batch (`block_n`: its default when None)."""
    block_n = block_n or _config(128, interpret)["BLOCK_N"]
    # Chunks of at least two steps on a GPU (a split's partial write and merge share then stay
    # small next to its K/V reads); one step in the interpreter, so short tests split too.
    min_chunk = block_n if interpret else 2 * block_n
    sms = num_sms(device, interpret)
    return plan_splits(batch, kv_heads, max_keys, sms, block_n, min_chunk=min_chunk, num_splits=num_splits)


def _config(head_dim: int, interpret: bool) -> dict:
    """Keys per step: 64 x head dim 128 per K and V tile keeps two pipeline stages in shared
    memory with room to spare; the interpreter prefers big steps (each op is one NumPy call)."""
    if interpret:
        return {"BLOCK_N": INTERPRET_BLOCK_N}
    if head_dim > 128:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


INTERPRET_BLOCK_N = 128


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, interpret: bool) -> None:
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash-decoding: head dim {head_dim} is not supported (supported: {HEAD_DIMS})")
    if q.dtype not in DTYPES:
        raise ValueError(f"flash-decoding: dtype {q.dtype} is not supported (supported: {DTYPES})")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"flash-decoding: {q.shape[1]} query heads do not group over {k_cache.shape[2]} KV heads"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("flash-decoding: the K and V caches must share one shape and layout")
    if interpret:
        enable_interpreter("flash-decoding")  # already on, or a plain error saying how to turn it on
    elif q.device.type != "cuda":
        raise RuntimeError(
            f"flash-decoding: tensors are on {q.device}; the kernel needs CUDA, or interpret=True "
            "(the Triton interpreter, for testing)"
        )


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its seq_lens[i] cached tokens.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    int32; `max_seq_len` = max(seq_lens) from the host (no device sync). `num_splits` fixes the
    split count; `config` overrides the tile size (BLOCK_N, num_warps, num_stages; for
    benchmarks). `k_scale`, `v_scale` ([Hkv] fp32): the caches hold K / k_scale and V / v_scale
    (a scaled float8 cache). `logit_softcap`: scores (after the scale) become
    cap x tanh(score / cap) (Gemma 2). Returns [B, Hq, D]."""
    check_inputs(q, k_cache, v_cache, interpret)
    batch, hq, head_dim = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    cfg = {**_config(head_dim, interpret), **(config or {})}
    max_keys = min(max_seq_len, sliding_window) if sliding_window is not None else max_seq_len
    plan = choose_splits(batch, hkv, max_keys, q.device, interpret, cfg["BLOCK_N"], num_splits)
    block_d = max(16, next_pow2(head_dim))
    if plan.num_splits == 1:
        partial, lse = out, out  # lse unused
        p_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        l_strides = (0, 0, 0)
    else:
        partial = torch.empty(batch, hq, plan.num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, hq, plan.num_splits, dtype=torch.float32, device=q.device)
        p_strides, l_strides = partial.stride(), lse.stride()
    _split_kernel[(batch, hkv, plan.num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        q if k_scale is None else k_scale,  # a placeholder pointer when unscaled (never read)
        q if v_scale is None else v_scale,
        scale * math.log2(math.e),
        sliding_window or 0,
        float(logit_softcap or 1.0),  # never read without HAS_SOFTCAP
        plan.chunk,
        *q.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        *p_strides,
        *l_strides,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        WRITE_LSE=plan.num_splits > 1,
        HAS_KV_SCALE=k_scale is not None,
        HAS_SOFTCAP=bool(logit_softcap),
        UPCAST=interpret and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
    )
    if plan.num_splits > 1:
        _merge_kernel[(batch, hq)](
            partial,
            lse,
            out,
            plan.num_splits,
            *partial.stride(),
            *lse.stride(),
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(plan.num_splits)),
        )
    return out
