"""The flash-attention prefill kernel, in the Triton interpreter, against the dense reference.

The conformance kit draws fresh random inputs each run: sequence lengths 1-300 (mostly not
block multiples), block sizes 1/4/16, GQA ratios 1/3/8, head dims 64/128, fp32/fp16/bf16 (bf16
computed in fp32 in the interpreter, whose bf16 arithmetic is wrong: see the kernel's UPCAST).
The interpreter is slow, so each check runs 9 random combinations that together use every value
of every axis, instead of all 54.
"""

from __future__ import annotations

import random

import pytest
import torch

from lmstack.batch import AttentionMetadata
from lmstack.testing import AttentionConformance, reference_attention
from lmstack.testing.attention import rel_error
from lmstack_flash_attention.backend import FlashAttention
from lmstack_flash_attention.plugin import COMPONENT


@pytest.fixture(scope="module")
def flash() -> FlashAttention:
    return FlashAttention(interpret=True)


class TestFlashAttentionConformance(AttentionConformance):
    # The registered component, built through its factory; the matrix is narrowed from what it
    # declares (11 head dims, 9 block sizes) to keep the interpreter run short.
    component = COMPONENT
    options = {"interpret": True}
    head_dims = (64, 128)
    block_sizes = (1, 4, 16)
    max_len = 300
    large_decode_batch = 16
    cases = 9


def _paged(seqs, hkv, head_dim, block_size, dtype=torch.float32):
    """seqs: [(context_len, query_len)] -> dense K/V per sequence and a shuffled paged cache."""
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 2
    free = list(range(num_blocks))
    random.shuffle(free)
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables, dense = [], []
    for c, q in seqs:
        table = [free.pop() for _ in range(-(-(c + q) // block_size))]
        k = torch.randn(c + q, hkv, head_dim).to(dtype)
        v = torch.randn(c + q, hkv, head_dim).to(dtype)
        pos = torch.arange(c + q)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        tables.append(table)
        dense.append((k, v))
    meta = AttentionMetadata.build([q for _, q in seqs], [c for c, _ in seqs], tables, block_size)
    return k_cache, v_cache, meta, dense


def test_padded_head_dim_and_strided_query(flash):
    """Head dim 80 runs padded to 128 lanes; q is a strided view, as the model passes it (Q and
    K heads side by side in one fused projection)."""
    hkv, group, head_dim = 2, 3, 80
    seqs = [(37, 45), (0, 130)]
    k_cache, v_cache, meta, dense = _paged(seqs, hkv, head_dim, block_size=16)
    fused = torch.randn(meta.num_tokens, hkv * group + hkv, head_dim)
    q = fused[:, : hkv * group]
    assert not q.is_contiguous()
    out = flash.prefill(q, None, None, k_cache, v_cache, meta, scale=head_dim**-0.5, sliding_window=None)
    start = 0
    for (c, ql), (k, v) in zip(seqs, dense, strict=True):
        ref = reference_attention(q[start : start + ql], k, v, c, head_dim**-0.5)
        assert rel_error(out[start : start + ql], ref) < 2e-5
        start += ql


@pytest.mark.parametrize("group", [1, 3, 8])
def test_small_tiles_over_long_context_with_window(flash, group, monkeypatch):
    """Interpreter tiles cut down to GPU-like proportions (32 rows, 16 keys): many query tiles
    per sequence, unmasked steps before each tile's first position, masked steps after it, and
    a window cutting into the cached context."""
    from lmstack_flash_attention import kernel

    monkeypatch.setattr(kernel, "INTERPRET_BLOCK_M", 32)
    monkeypatch.setattr(kernel, "INTERPRET_BLOCK_N", 16)
    hkv, head_dim = 1, 64
    seqs = [(150, 90)]
    k_cache, v_cache, meta, dense = _paged(seqs, hkv, head_dim, block_size=4)
    q = torch.randn(meta.num_tokens, hkv * group, head_dim)
    for window in (None, 70):
        out = flash.prefill(q, None, None, k_cache, v_cache, meta, scale=0.1, sliding_window=window)
        ref = reference_attention(q, *dense[0], 150, 0.1, window)
        assert rel_error(out, ref) < 2e-5


def test_unsupported_head_dim_is_refused_plainly(flash):
    k_cache = torch.zeros(4, 16, 1, 72)
    meta = AttentionMetadata.build([3], [0], [[0]], 16)
    with pytest.raises(ValueError, match="head dim 72 is not supported"):
        flash.prefill(
            torch.zeros(3, 2, 72), None, None, k_cache, k_cache, meta, scale=1.0, sliding_window=None
        )


def test_cpu_tensors_without_the_interpreter_are_refused():
    from lmstack_flash_attention.kernel import flash_prefill

    meta = AttentionMetadata.build([3], [0], [[0]], 16)
    k_cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="needs CUDA, or interpret=True"):
        flash_prefill(
            torch.zeros(3, 2, 64),
            k_cache,
            k_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            3,
            scale=1.0,
            interpret=False,
        )
