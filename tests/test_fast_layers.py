"""The decoder's fast path (`lmstack.model.fast_layers`, bound by `LlamaModel.bind_fast_layers`)
and the attention backends' optional per-step decode call (`bind_decode`) compute exactly
what the generic path computes: the oracle is the same engine with both turned off, compared on
greedy tokens and on every prompt and sampled token's log-probability, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lmstack.engine.llm import LLM
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import one_thread, tiny_stack

PROMPTS = [list(range(5, 45)), [7, 3, 9], list(range(60, 77))]


def _runner(llm):
    return llm.engine.executor.runner


def _generate(llm) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with one_thread():
        outs = llm.generate(PROMPTS, params)
    results = []
    for prompt, out in zip(PROMPTS, outs):
        prompt_lp = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        comp = out.outputs[0]
        sampled = [lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)]
        results.append((comp.token_ids, prompt_lp + sampled))
    return results


def _generic(llm, monkeypatch) -> None:
    """Turn both fast paths off for this engine."""
    _runner(llm).model._fast_layers = None
    backend = type(_runner(llm).decode_backend)
    monkeypatch.setattr(backend, "bind_decode", lambda self, meta: None, raising=False)


def _counting(model) -> list[int]:
    """Wrap the bound fast layers so that their calls are counted (proof the path ran)."""
    fast = model._fast_layers
    count = [0]

    def wrap(fn):
        def run(*a):
            count[0] += 1
            return fn(*a)

        return run

    fast.calls = tuple(wrap(f) for f in fast.calls)
    return count


@pytest.mark.parametrize("attention", ["cpu-paged", "torch"])
def test_fast_path_is_the_generic_path_bit_for_bit(tiny_model_path, attention, monkeypatch) -> None:
    if attention == "cpu-paged":
        pytest.importorskip("lmstack_cpu_paged")
    llm = LLM(tiny_stack(tiny_model_path, attention=attention))
    try:
        model = _runner(llm).model
        assert model._fast_layers is not None  # the tiny Llama qualifies
        count = _counting(model)
        fast = _generate(llm)
        # Prefill (up to the row limit) and every decode step went through the fast layers.
        assert count[0] >= 6 * len(model.layers)
        _generic(llm, monkeypatch)
        generic = _generate(llm)
    finally:
        llm.engine.shutdown()
    for (tokens_f, lp_f), (tokens_g, lp_g) in zip(fast, generic):
        assert tokens_f == tokens_g
        assert lp_f == lp_g


def test_a_hook_turns_the_fast_path_off_while_it_is_registered(tiny_model_path) -> None:
    llm = LLM(tiny_stack(tiny_model_path))
    try:
        model = _runner(llm).model
        x = torch.zeros(1, model.config.hidden_size)
        with torch.inference_mode():
            assert model._fast_layers.for_step(x) is not None
            seen = []
            handle = model.layers[1].gate_up_proj.register_forward_hook(
                lambda mod, args, out: seen.append(out.shape)
            )
            assert model._fast_layers.for_step(x) is None
            with one_thread():
                llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            assert seen  # the generic path ran the hook
            handle.remove()
            assert model._fast_layers.for_step(x) is not None
            # Outside inference mode (a tool tuning scales with autograd), and over the row limit.
        assert model._fast_layers.for_step(x) is None
        model._fast_layers.most_rows = 0
        with torch.inference_mode():
            assert model._fast_layers.for_step(x) is None
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("llama3", True),
        ("mistral", True),
        ("qwen2", True),
        ("phi3", False),
        ("qwen3", False),
        ("qwen3_moe", False),
    ],
)
def test_which_layers_take_the_fast_path(family, expected, tmp_path) -> None:
    """Layers with a family switch between the kernels (Qwen3's per-head q/k norm, the tiny
    Phi-3's partial rotary, a mixture of experts) keep the generic forward; Qwen2's q/k/v biases
    run inside the linear's forward."""
    pytest.importorskip("transformers")
    from lmstack.testing.tiny_families import write_tiny_family

    llm = LLM(tiny_stack(write_tiny_family(family, tmp_path / family)))
    try:
        assert (_runner(llm).model._fast_layers is not None) is expected
    finally:
        llm.engine.shutdown()


def test_qwen2_biases_fast_path_is_the_generic_path(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    from lmstack.testing.tiny_families import write_tiny_family

    llm = LLM(tiny_stack(write_tiny_family("qwen2", tmp_path / "qwen2")))
    try:
        fast = _generate(llm)
        _generic(llm, monkeypatch)
        assert _generate(llm) == fast
    finally:
        llm.engine.shutdown()
