"""The flash-decoding kernels, in the Triton interpreter, against the dense reference.

The conformance kit draws fresh random inputs each run (context lengths 0-300, block sizes
1/4/16, GQA ratios 1/3/8, head dims 64/128, fp32/fp16/bf16 — bf16 computed in fp32 in the
interpreter, whose bf16 arithmetic is wrong); each check runs 9 random combinations that
together use every value of every axis. The interpreter pretends to have 4 SMs, so short
batches are split several ways and large ones are not: both paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from lmstack.batch import AttentionMetadata
from lmstack.testing import AttentionConformance, reference_attention
from lmstack.testing.attention import rel_error
from lmstack_flash_decoding.backend import FlashDecoding
from lmstack_flash_decoding.plugin import COMPONENT


@pytest.fixture(scope="module")
def flash() -> FlashDecoding:
    return FlashDecoding(interpret=True)


class TestFlashDecodingConformance(AttentionConformance):
    # The registered component (it declares the decode phase only), built through its factory;
    # the matrix is narrowed from what it declares to keep the interpreter run short.
    component = COMPONENT
    options = {"interpret": True}
    head_dims = (64, 128)
    block_sizes = (1, 4, 16)
    max_len = 300
    large_decode_batch = 24
    cases = 9


def _decode_batch(context_lens, hkv, group, head_dim, block_size, dtype=torch.float32):
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    free = list(range(num_blocks))
    random.shuffle(free)
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables, dense = [], []
    for n in context_lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, hkv, head_dim).to(dtype), torch.randn(n, hkv, head_dim).to(dtype)
        pos = torch.arange(n)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        tables.append(table)
        dense.append((k, v))
    # Decode metadata: each sequence's last cached token is its query.
    meta = AttentionMetadata.build([1] * len(context_lens), [n - 1 for n in context_lens], tables, block_size)
    q = torch.randn(len(context_lens), hkv * group, head_dim).to(dtype)
    return q, k_cache, v_cache, meta, dense


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_forced_splits_with_empty_chunks(num_splits):
    """A fixed split count over very different lengths: the short sequences' later chunks are
    empty (log-sum-exp -inf, weight 0 in the merge)."""
    backend = FlashDecoding(interpret=True, num_splits=num_splits)
    lens = [5, 260, 1, 70]
    q, k_cache, v_cache, meta, dense = _decode_batch(lens, hkv=2, group=3, head_dim=64, block_size=8)
    out = backend.decode(q, k_cache, v_cache, meta, scale=0.125, sliding_window=None)
    for i, n in enumerate(lens):
        ref = reference_attention(q[i : i + 1], *dense[i], n - 1, 0.125)
        assert rel_error(out[i : i + 1], ref) < 2e-5, (n, num_splits)


def test_split_decode_with_window_and_padded_head_dim():
    backend = FlashDecoding(interpret=True, num_splits=4)
    lens = [300, 40]
    q, k_cache, v_cache, meta, dense = _decode_batch(lens, hkv=1, group=8, head_dim=80, block_size=16)
    out = backend.decode(q, k_cache, v_cache, meta, scale=0.1, sliding_window=100)
    for i, n in enumerate(lens):
        ref = reference_attention(q[i : i + 1], *dense[i], n - 1, 0.1, 100)
        assert rel_error(out[i : i + 1], ref) < 2e-5


@pytest.mark.parametrize("num_splits", [1, 4])
def test_softcap_across_splits(num_splits):
    """Soft-capped scores (Gemma 2) with the keys split several ways and merged: each split caps
    its own scores before its softmax, so the merge sees capped log-sum-exps."""
    backend = FlashDecoding(interpret=True, num_splits=num_splits)
    lens = [300, 40, 3]
    q, k_cache, v_cache, meta, dense = _decode_batch(lens, hkv=2, group=4, head_dim=64, block_size=16)
    for window in (None, 50):
        out = backend.decode(q, k_cache, v_cache, meta, scale=0.5, sliding_window=window, logit_softcap=2.0)
        for i, n in enumerate(lens):
            ref = reference_attention(q[i : i + 1], *dense[i], n - 1, 0.5, window, 2.0)
            assert rel_error(out[i : i + 1], ref) < 2e-5, (n, window)


def test_split_plan():
    from lmstack_flash_decoding.kernel import MAX_SPLITS, plan_splits

    # One long sequence on an H200 (132 SMs), 8 KV heads: many splits.
    p = plan_splits(1, 8, 32768, 132, 64, min_chunk=256)
    assert 32 <= p.num_splits <= MAX_SPLITS
    assert p.chunk % 64 == 0 and p.chunk * p.num_splits >= 32768 > p.chunk * (p.num_splits - 1)
    # A batch that fills the GPU already: no split, no merge.
    assert plan_splits(128, 8, 32768, 132, 64, min_chunk=256).num_splits == 1
    # Short contexts are not cut below min_chunk.
    assert plan_splits(1, 8, 300, 132, 64, min_chunk=256).num_splits == 2
    assert plan_splits(1, 8, 100, 132, 64, min_chunk=256).num_splits == 1
    # An override is honoured, within the context length and MAX_SPLITS.
    assert plan_splits(4, 8, 4096, 132, 64, min_chunk=256, num_splits=5).num_splits == 5
    assert plan_splits(4, 8, 100, 132, 64, min_chunk=256, num_splits=5).num_splits == 2
    assert plan_splits(1, 1, 10**6, 132, 64, min_chunk=64, num_splits=1000).num_splits == MAX_SPLITS


def test_prefill_is_refused():
    backend = FlashDecoding(interpret=True)
    with pytest.raises(NotImplementedError, match="decode only"):
        backend.prefill(None, None, None, None, None, None, scale=1.0, sliding_window=None)
