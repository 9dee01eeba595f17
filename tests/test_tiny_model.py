"""The tiny random-weight Llama fixture: a real Llama (transformers computes the same logits),
loaded by lmstack's own loader, deterministic per seed, and not degenerate."""

from __future__ import annotations

import json

import pytest
import torch

from lmstack.model.source import open_model_source
from lmstack.sampling_params import SamplingParams
from lmstack.testing.components import TINY_MODEL_CONFIG
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack
from lmstack.testing.tiny_model import write_tiny_model

PROMPT = "the cat sat on the mat, and then the cat sat on the hat"


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_model_path):
    again = write_tiny_model(tmp_path / "a")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_path / name).read_bytes(), name
    other = write_tiny_model(tmp_path / "b", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_loads_through_lmstack_with_the_geometry_the_kits_assume(tiny_model_path):
    source = open_model_source(tiny_model_path)
    cfg = source.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)  # GQA
    geometry = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    assert {k: getattr(cfg, k) for k in geometry} == {k: getattr(TINY_MODEL_CONFIG, k) for k in geometry}
    tok = source.tokenizer
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_token_ids == (tok.encode("<|im_end|>")[0],)
    ids = tok.encode("the cat")
    assert len(ids) < len("the cat") and tok.decode(ids) == "the cat"  # merges apply
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert (
        tok.decode(chat, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generates_varied_deterministic_text(tiny_model_path):
    llm = reference_llm(tiny_stack(tiny_model_path))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with one_thread():
        first, second = llm.generate(PROMPT, params)[0], llm.generate(PROMPT, params)[0]
        chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=4))
    assert first.token_ids == second.token_ids
    assert len(set(first.token_ids)) >= 4, f"degenerate greedy output {first.token_ids}"
    assert chat[0].outputs[0].token_ids


def test_matches_transformers_llama(tiny_model_path):
    """Our engine's fp32 log-probabilities (teacher-forced over the prompt) and greedy tokens
    equal transformers' LlamaForCausalLM's on the same folder."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert json.loads((tiny_model_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    llm = reference_llm(tiny_stack(tiny_model_path))
    ids = llm.tokenizer.encode(PROMPT)
    with one_thread():
        out = llm.generate(
            ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        )[0]
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        expected = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :]
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    theirs = torch.stack([logprobs[i - 1, ids[i]] for i in range(1, len(ids))])
    assert (ours - theirs).abs().max() < 1e-4
    assert out.token_ids == expected.tolist()


def test_hooks_on_the_models_modules_still_run(tiny_model_path):
    """The decoder calls its modules' `forward` directly where no hook is registered (a CPU
    saving at batch 1); a module's own hooks and global ones still run, and change the output
    when they change a module's."""
    llm = reference_llm(tiny_stack(tiny_model_path))
    model = llm.engine.executor.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPT, params)[0].token_ids
    seen: list[str] = []
    handles = [
        model.layers[0].register_forward_pre_hook(lambda m, a: seen.append("layer 0")),
        model.layers[1].qkv_proj.register_forward_hook(lambda m, a, out: seen.append("qkv 1")),
        model.layers[1].post_attention_layernorm.register_forward_hook(
            lambda m, a, out: seen.append("norm 1")
        ),
        # Zeroing every MLP's contribution changes what the model says.
        *(layer.down_proj.register_forward_hook(lambda m, a, out: out * 0) for layer in model.layers),
    ]
    try:
        hooked = llm.generate(PROMPT, params)[0].token_ids
    finally:
        for h in handles:
            h.remove()
    assert {"layer 0", "qkv 1", "norm 1"} <= set(seen)
    assert hooked != plain
    calls: list[type] = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append(type(m)))
    try:
        assert llm.generate(PROMPT, params)[0].token_ids == plain
    finally:
        handle.remove()
    assert model.layers[0].qkv_proj.__class__ in calls and model.layers[0].__class__ in calls
    assert llm.generate(PROMPT, params)[0].token_ids == plain
