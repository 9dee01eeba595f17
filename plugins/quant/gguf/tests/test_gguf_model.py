"""SmolLM2-135M-Instruct (the Q4_1 GGUF the project serves) with `quant: {weights: gguf}` against
the same checkpoint dequantized at load (`quant: {weights: none}`): the layers keep their Q4_1
blocks and the tied head Q8_0 blocks (under 0.75 bytes a weight), and greedy output and prompt
log-probabilities match the dequantized model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import generate
from lmstack_gguf.head import BlockEmbedding
from lmstack_gguf.kernel import native_kernel
from lmstack_gguf.linear import GGUFLinear

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "stacks" / "cpu.yaml"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


def _llm(weights: str, **extra):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    stack = {
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
        "device": "cpu",
        "attention": "torch",
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 128},
        "quant": {"weights": weights},
    }
    for key, value in extra.items():
        stack[key] = {**stack.get(key, {}), **value}
    return LLM(stack, plugin_manager=make_plugin_manager())


@pytest.fixture(scope="module")
def pair():
    # fp32 activations and K/V (not gguf's defaults, int8 and bfloat16): the dequantized
    # checkpoint's own arithmetic, which the comparisons below hold it to.
    ours, ref = _llm("gguf", quant={"activations": "fp32", "kv_cache": "none"}), _llm("none")
    yield ours, ref
    ours.engine.shutdown()
    ref.engine.shutdown()


def test_blocks_are_kept_and_small(pair):
    if native_kernel() is None:
        pytest.skip("the kernels did not build: every layer is dense")
    model = pair[0].engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert {m.ggml_type for m in linears} == {3, 8}  # Q4_1 layers, the Q8_0 table
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.lm_head is model.embed_tokens.table
    tables = {id(m): m for m in linears}.values()
    weights = sum(m.in_features * m.out_features for m in tables)
    assert sum(m.weight.nbytes for m in tables) / weights < 0.75
    assert not [n for n, p in model.named_parameters() if p.dim() == 2 and p.dtype == torch.float32]


def test_output_matches_the_dequantized_checkpoint(pair):
    ours, ref = pair
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    a, b = generate(ours, PROMPTS, sp), generate(ref, PROMPTS, sp)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        ids = y.prompt_token_ids
        for pos in range(1, len(ids)):
            assert abs(x.prompt_logprobs[pos][ids[pos]] - y.prompt_logprobs[pos][ids[pos]]) < 1e-4
        for lp, lq, tok in zip(
            x.outputs[0].logprobs, y.outputs[0].logprobs, y.outputs[0].token_ids, strict=True
        ):
            assert abs(lp[tok] - lq[tok]) < 1e-3  # decode: the kernel's fp32 sums in another order


def test_int8_activations_cost_little_accuracy(pair):
    """`activations: int8` (x rounded to int8 per 32-block, llama.cpp's scheme), prefilled in
    chunks of 16 rows so that every layer runs the int8 kernel: on the dequantized checkpoint's
    own greedy text, the prompt log-probabilities stay close and the mean NLL within 2 %."""
    if native_kernel() is None:
        pytest.skip("the kernels did not build: every layer is dense")
    ref = pair[1]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.prompt_token_ids + o.outputs[0].token_ids for o in generate(ref, PROMPTS, sp)]
    int8 = _llm("gguf", quant={"activations": "int8"}, scheduler={"max_num_batched_tokens": 16})
    try:
        model = int8.engine.executor.runner.model
        assert all(m.int8_activations for m in model.modules() if isinstance(m, GGUFLinear))
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        ours, theirs = generate(int8, texts, score), generate(ref, texts, score)
    finally:
        int8.engine.shutdown()
    diffs, nll, nll_ref = [], 0.0, 0.0
    for x, y, ids in zip(ours, theirs, texts, strict=True):
        for pos in range(1, len(ids)):
            a, b = x.prompt_logprobs[pos][ids[pos]], y.prompt_logprobs[pos][ids[pos]]
            diffs.append(abs(a - b))
            nll, nll_ref = nll - a, nll_ref - b
    assert max(diffs) > 1e-3  # x was rounded: the int8 kernel ran, not the fp32 one
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 1.0, (sum(diffs) / len(diffs), max(diffs))
    assert abs(nll - nll_ref) / nll_ref < 0.02, (nll, nll_ref)


def test_example_stack_resolves():
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import default_registry
    from lmstack.stack.resolve import resolve

    r = resolve(load_stack(EXAMPLE), default_registry())
    assert r.quantizer.name == "gguf" and r.dtype == torch.float32
