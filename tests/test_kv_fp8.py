"""An FP8 (float8_e4m3fn) KV cache end to end on the tiny model: capacity, scales, outputs,
and blocks swapped out and back in."""

from __future__ import annotations

import pytest
import torch

from lmstack.content_hash import CacheGeometry
from lmstack.engine.llm import LLM
from lmstack.quant.kv import dequantize_kv, quantize_kv
from lmstack.sampling_params import SamplingParams
from lmstack.stack.config import load_stack
from lmstack.testing import reference_attention
from lmstack.testing.kit import one_thread, tiny_stack

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g h i j k l m n o p q r s t u v w x y z"]


def _llm(model_path, kv: str, **sections) -> LLM:
    stack = tiny_stack(
        model_path,
        allocator={"name": "paged", "block_size": 16, "kv_cache_memory": "1MiB"},
        # 12-token chunks: later chunks of a prompt attend to its earlier ones in the cache.
        scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 12},
        quant={"kv_cache": kv},
        **sections,
    )
    return LLM(stack)


@pytest.fixture(scope="module")
def fp8_llm(tiny_model_path):
    llm = _llm(tiny_model_path, "fp8_e4m3")
    yield llm
    llm.engine.shutdown()


def test_the_issue_spelling_and_the_torch_names_both_parse():
    for kv, dtype in (
        ("fp8_e4m3", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
    ):
        assert load_stack({"quant": {"kv_cache": kv}}).quant["kv_cache"] == dtype


def test_twice_the_blocks_of_bf16_in_the_same_memory(tiny_model_path, fp8_llm):
    bf16 = _llm(tiny_model_path, "bfloat16")
    try:
        blocks_bf16 = bf16.engine.allocator.num_blocks
    finally:
        bf16.engine.shutdown()
    # Per-layer, per-head scales are a fixed few bytes, not per block: exactly 2x.
    assert fp8_llm.engine.allocator.num_blocks == 2 * blocks_bf16
    k_cache, _ = fp8_llm.engine.executor.runner.kv_caches[0]
    assert k_cache.dtype is torch.float8_e4m3fn


def test_scales_per_layer_and_kv_head_fixed_by_a_deterministic_calibration(tiny_model_path, fp8_llm):
    runner = fp8_llm.engine.executor.runner
    cfg = runner.config
    assert len(runner.kv_scales) == cfg.num_layers
    for k_scale, v_scale in runner.kv_scales:
        assert k_scale.shape == v_scale.shape == (cfg.num_kv_heads,)
        assert (k_scale > 0).all() and (v_scale > 0).all()
    # A second engine on the same model derives the same scales: blocks a disk tier kept from
    # an earlier run are read back under the scales they were written with.
    again = _llm(tiny_model_path, "fp8_e4m3")
    try:
        for (k1, v1), (k2, v2) in zip(runner.kv_scales, again.engine.executor.runner.kv_scales, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    finally:
        again.engine.shutdown()


class _DenseOverDequantizedKV:
    """Attention for one unpaged sequence over K/V rounded through the fp8 cache's scales."""

    def __init__(self, scales, dtype) -> None:
        self.scales, self.dtype = scales, dtype

    def attend(self, layer, q, k, v):
        ks, vs = self.scales[layer]
        k = dequantize_kv(quantize_kv(k, ks, self.dtype), ks, q.dtype)
        v = dequantize_kv(quantize_kv(v, vs, self.dtype), vs, q.dtype)
        return reference_attention(q, k, v, 0, q.shape[-1] ** -0.5).to(q.dtype)


def test_logprobs_are_attention_over_the_dequantized_cache(fp8_llm):
    """The paged engine (prompts prefilled in chunks over cached context, then decode steps,
    all reading the fp8 cache) gives the logprobs of a dense forward whose K/V were rounded
    through the same scales: prompt tokens and generated tokens alike."""
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    with one_thread():
        outs = fp8_llm.generate(PROMPTS, params)
    runner = fp8_llm.engine.executor.runner
    for out in outs:
        gen = out.outputs[0]
        ids = torch.tensor(out.prompt_token_ids + gen.token_ids)
        with torch.inference_mode():
            dense = _DenseOverDequantizedKV(runner.kv_scales, runner.kv_cache_dtype)
            logits, _ = runner.model(ids, torch.arange(len(ids)), dense)
        ref = logits.log_softmax(-1)[torch.arange(len(ids) - 1), ids[1:]]
        got = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)]
        got += [lp[t] for lp, t in zip(gen.logprobs, gen.token_ids, strict=True)]
        assert (torch.tensor(got[: len(ref)]) - ref).abs().max() < 1e-3


def test_fp8_blocks_swap_out_and_back_in_bit_exact(fp8_llm):
    """What a lower tier gets from swap_out and hands back to swap_in: the stored bytes (the
    scales never change, so a block read back means what it meant when written)."""
    runner = fp8_llm.engine.executor.runner
    blocks = [3, 0, 7]
    for k_cache, v_cache in runner.kv_caches:
        k_cache[blocks] = torch.randn(len(blocks), *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[blocks] = torch.randn(len(blocks), *v_cache.shape[1:]).to(v_cache.dtype)
    before = [
        (k[blocks].view(torch.uint8).clone(), v[blocks].view(torch.uint8).clone())
        for k, v in runner.kv_caches
    ]
    out = runner.swap_out(blocks)
    assert all(d.dtype is torch.float8_e4m3fn for d in out)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.zero_(), v_cache.zero_()
    runner.swap_in(list(zip(blocks, out, strict=True)))
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k[blocks].view(torch.uint8), k0) and torch.equal(v[blocks].view(torch.uint8), v0)


def test_fp8_blocks_round_trip_through_the_disk_tier_format():
    store = pytest.importorskip("lmstack_tiered_cache.store")
    geometry = CacheGeometry("m", "cfg", "float32", "none", 2, 3, 8, "float8_e4m3fn", 4)
    data = torch.randn(geometry.block_shape).to(torch.float8_e4m3fn)
    back = store.decode_block(store.encode_block(geometry, 5, data), geometry, 5, torch.float8_e4m3fn)
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))
