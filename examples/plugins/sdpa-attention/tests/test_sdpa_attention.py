"""The example attention plugin `sdpa`: the core's attention conformance kit on the registered
component, its repeated-KV-heads path against the enable_gqa one, and greedy generation on the
tiny random-weight model identical to the reference `torch` kernels'.

    pip install -e examples/plugins/sdpa-attention && python -m pytest examples/plugins/sdpa-attention/tests
"""

from __future__ import annotations

import random

import torch

from lmstack import LLM, SamplingParams
from lmstack.batch import AttentionMetadata
from lmstack.testing import AttentionConformance
from lmstack_sdpa_attention import SdpaAttention

pytest_plugins = ["lmstack.testing.fixtures"]


class TestSdpaConformance(AttentionConformance):
    component = "sdpa"
    # Three random (dtype, head_dim, block_size, GQA ratio) combinations per check, fresh each
    # run, together covering every value of every axis; shorter sequences than the default.
    cases = 3
    max_len = 96


def _paged_batch(spans, hkv=2, group=4, head_dim=32, block_size=4):
    """A shuffled paged cache holding every token of sequences with (context, query) lengths."""
    tables, free = [], list(range(sum(-(-(c + q) // block_size) for c, q in spans)))
    random.shuffle(free)
    k_cache = torch.randn(len(free), block_size, hkv, head_dim)
    v_cache = torch.randn_like(k_cache)
    for c, q in spans:
        tables.append([free.pop() for _ in range(-(-(c + q) // block_size))])
    meta = AttentionMetadata.build([q for _, q in spans], [c for c, _ in spans], tables, block_size)
    num_tokens = sum(q for _, q in spans)
    q = torch.randn(num_tokens, hkv * group, head_dim)
    k, v = torch.randn(num_tokens, hkv, head_dim), torch.randn(num_tokens, hkv, head_dim)
    SdpaAttention().write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def test_repeated_kv_heads_match_enable_gqa():
    gqa, repeated = SdpaAttention(enable_gqa=True), SdpaAttention(enable_gqa=False)
    q, k, v, kc, vc, meta = _paged_batch([(0, 9), (13, 5), (30, 1)])
    for window in (None, 6):
        a = gqa.prefill(q, k, v, kc, vc, meta, scale=0.2, sliding_window=window)
        b = repeated.prefill(q, k, v, kc, vc, meta, scale=0.2, sliding_window=window)
        torch.testing.assert_close(a, b)
    q, k, v, kc, vc, meta = _paged_batch([(7, 1), (0, 1), (40, 1)])
    a = gqa.decode(q, kc, vc, meta, scale=0.2, sliding_window=None)
    torch.testing.assert_close(a, repeated.decode(q, kc, vc, meta, scale=0.2, sliding_window=None))


STACK = {
    "dtype": "float32",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 64},
    "allocator": {"name": "paged", "block_size": 4, "kv_cache_memory": "16MiB"},
}


def _generate(model_path, kernel: str) -> list[list[int]]:
    llm = LLM({**STACK, "model": str(model_path), "attention": {"prefill": kernel, "decode": kernel}})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Three prompts decode together; the 70-token one is prefilled in two chunks (budget 64).
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7] * 35, [5]]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def test_greedy_output_matches_the_torch_kernels(tiny_model_path):
    sdpa = _generate(tiny_model_path, "sdpa")
    assert [len(tokens) for tokens in sdpa] == [12, 12, 12]
    assert sdpa == _generate(tiny_model_path, "torch")
