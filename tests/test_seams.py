"""Seams later plugins use, exercised through the real engine: a quantizer that swaps linear
modules and changes the KV-cache dtype, lifecycle hooks, and Hugging Face folders with an untied
head, biases and RoPE scaling checked against transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmstack import SamplingParams
from lmstack.engine.llm_engine import LLMEngine
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import Quantizer
from lmstack.model.linear import default_linear
from lmstack.outputs import RequestOutput
from lmstack.registry import Component
from lmstack.stack.plugins import make_plugin_manager


class Int8Linear(nn.Module):
    """Weight-only int8 with per-output-channel scales, dequantized on the fly."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        self.register_buffer("q", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        return nn.functional.linear(x, self.q.to(x.dtype) * self.scale, self.bias)


class FakeInt8(Quantizer):
    kv_cache_dtype = torch.float16

    def __init__(self):
        self.built: list[str] = []

    def linear_factory(self):
        def make(spec):
            self.built.append(spec.name)
            return default_linear(spec)

        return make

    def process_model(self, model):
        for layer in model.layers:
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                setattr(layer, attr, Int8Linear(getattr(layer, attr)))


class Plugin:
    def __init__(self):
        self.quantizer = FakeInt8()
        self.events: list[str] = []
        self.final_outputs: list[RequestOutput] = []

    @hookimpl
    def lmstack_register_quantizers(self, register):
        register(
            Component(
                name="fake-int8",
                kind="quantizer",
                factory=lambda o, c: self.quantizer,
                capabilities={"kv_cache_dtype": "float16"},
            )
        )

    @hookimpl
    def lmstack_engine_started(self, engine):
        self.events.append("started")

    @hookimpl
    def lmstack_step_finished(self, engine, stats):
        self.events.append("step")

    @hookimpl
    def lmstack_request_finished(self, engine, output):
        self.events.append(f"finished:{output.request_id}")
        self.final_outputs.append(output)


@pytest.fixture(scope="module")
def quantized():
    plugin = Plugin()
    pm = make_plugin_manager(autoload=False, extra_plugins=[plugin])
    engine = LLMEngine(
        {
            "model": "smollm2-135m-instruct",
            "dtype": "float32",
            "quant": {"weights": "fake-int8"},
            "allocator": {"num_blocks": 64},
        },
        plugin_manager=pm,
    )
    return engine, plugin


def test_quantizer_builds_and_swaps_linears(quantized):
    engine, plugin = quantized
    assert "layers.0.qkv_proj" in plugin.quantizer.built and "layers.29.down_proj" in plugin.quantizer.built
    model = engine.executor.runner.model
    assert isinstance(model.layers[0].qkv_proj, Int8Linear)
    assert engine.stack.kv_cache_dtype == torch.float16  # agreed at resolution
    assert engine.executor.runner.kv_caches[0][0].dtype == torch.float16
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            text = o.text
    assert "Paris" in text
    assert plugin.events[0] == "started" and "step" in plugin.events and f"finished:{rid}" in plugin.events
    # The hook gets the request's final output, the one the caller got.
    (final,) = [o for o in plugin.final_outputs if o.request_id == rid]
    assert isinstance(final, RequestOutput) and final.finished and final.text == text
    assert final.metrics.finished_time is not None and final.num_cached_tokens == 0


def _tiny_hf_folder(tmp_path, hf_tok, **cfg_kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=1024,
        **cfg_kw,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is tiny; larger weights make the greedy path less degenerate
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "cfg_kw",
    [
        {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    ],
    ids=["untied-bias", "llama3-rope", "linear-rope", "yarn-rope"],
)
def test_hf_folder_models_match_transformers(tmp_path, hf_smollm2, cfg_kw):
    _, hf_tok = hf_smollm2
    ref = _tiny_hf_folder(tmp_path, hf_tok, **cfg_kw)
    engine = LLMEngine(
        {
            "model": str(tmp_path),
            "dtype": "float32",
            "allocator": {"num_blocks": 64},
            "scheduler": {"max_num_batched_tokens": 48},
        }
    )
    prompt = list(range(1000, 1130))  # long enough for scaled RoPE frequencies to matter; chunked
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    ours = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                ours = o.token_ids
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            eos_token_id=None,
            pad_token_id=0,
        )
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    assert ours == out[0, len(prompt) :].tolist()
    assert logits.std() > 0.5, "the random model should not be degenerate"


class ReplicaLayout:
    """A test parallel layout: two worker processes over torch.distributed (gloo), each with a
    full replica — the executor seam a TP / PP / EP plugin builds on."""

    def create_executor(self, spec):
        from lmstack.exec.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, world_size=2)


class ReplicaPlugin:
    @hookimpl
    def lmstack_register_parallel(self, register):
        register(Component(name="replicas", kind="parallel", factory=lambda o, c: ReplicaLayout()))


# The stack of test_engine.py: the in-process engine is the session's shared one.
FP32_STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "float32",
    "scheduler": {"name": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 128},
    "allocator": {"name": "paged", "block_size": 16, "num_blocks": 400},
    # Named, not auto: the multi-process engine below loads the built-ins only, where the autos
    # would choose other components than the shared engine's (GGUF blocks, cpu-paged, prefix).
    "quant": {"weights": "none"},
    "attention": "torch",
    "cache": "none",
}


def test_executor_runs_worker_processes_over_torch_distributed(shared_llm):
    stack = FP32_STACK
    prompt_msgs = [{"role": "user", "content": "What is the capital of France?"}]
    p = SamplingParams(temperature=0.0, max_tokens=10)
    single = shared_llm(stack).engine
    expected_rid = single.add_request(single.tokenizer.encode_chat(prompt_msgs), p)
    expected = None
    while single.has_unfinished():
        for o in single.step():
            if o.request_id == expected_rid and o.finished:
                expected = o.token_ids
    pm = make_plugin_manager(autoload=False, extra_plugins=[ReplicaPlugin()])
    multi = LLMEngine({**stack, "parallel": {"name": "replicas"}}, plugin_manager=pm)
    try:
        assert multi.executor.world_size == 2 and all(p.is_alive() for p in multi.executor._procs)
        rid = multi.add_request(multi.tokenizer.encode_chat(prompt_msgs), p)
        got = None
        while multi.has_unfinished():
            for o in multi.step():
                if o.request_id == rid and o.finished:
                    got = o.token_ids
        assert got == expected
    finally:
        multi.shutdown()
    assert not multi.executor._procs


class Fp8KV:
    @hookimpl
    def lmstack_register_quantizers(self, register):
        register(
            Component(
                name="kv-fp8",
                kind="quantizer",
                factory=lambda o, c: None,
                capabilities={"kv_cache_dtype": "float8_e4m3fn"},
            )
        )

    @hookimpl
    def lmstack_register_attention(self, register):
        # A kernel that reads 16-bit caches only (the built-in `torch` also reads float8).
        register(
            Component(
                name="half-only",
                kind="attention",
                factory=lambda o, c: None,
                capabilities={"kv_cache_dtypes": ("float16", "bfloat16"), "phases": ("prefill", "decode")},
            )
        )


def test_incompatible_stack_is_rejected_before_the_model_is_opened(monkeypatch):
    from lmstack.errors import ResolutionError
    from lmstack.stack import prepare as prepare_module

    def no_model(*a, **k):
        raise AssertionError("the model was opened before the conflict was reported")

    monkeypatch.setattr(prepare_module, "open_model_source", no_model)
    pm = make_plugin_manager(autoload=False, extra_plugins=[Fp8KV()])
    with pytest.raises(ResolutionError) as e:
        LLMEngine(
            {"quant": {"weights": "kv-fp8"}, "attention": {"prefill": "half-only", "decode": "half-only"}},
            plugin_manager=pm,
        )
    msg = str(e.value)
    assert "kv-fp8" in msg and "'half-only'" in msg
