"""Fast by default: every `auto` a stack starts with (device, quant.weights, attention, cache,
allocator.kv_cache_memory) chooses, says why, and falls back when its first choice does not fit.

Most tests resolve against a fake registry (nothing installed); the last ones check that a
stack naming only the model resolves to the hand-written CPU stack `make serve` used to serve,
and that prefix caching, on by default, leaves greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from lmstack.components.paged import (
    CPU_BLOCK_SIZE,
    GPU_BLOCK_SIZE,
    PagedOptions,
    auto_block_size,
    block_size_of,
)
from lmstack.components.paged import build as build_paged
from lmstack.errors import ConfigError, ResolutionError
from lmstack.interfaces import BuildContext
from lmstack.kernels import hardware
from lmstack.kernels.hardware import CPU_KV_CAP, kv_budget_from
from lmstack.quant.formats import CT_PACK_QUANTIZED, DENSE, GGUF
from lmstack.registry import Component, Registry
from lmstack.stack.config import load_stack
from lmstack.stack.resolve import auto_quantizer, auto_quantizer_ranking, resolve

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def comp(name: str, kind: str, **kw) -> Component:
    return Component(name=name, kind=kind, factory=lambda o, c: None, distribution="lmstack-fake", **kw)


class SchedOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: int = 8


BASE = [
    comp("continuous", "scheduler", options_type=SchedOptions),
    # The real paged allocator's options (kv_cache_memory: auto) and hashing capability.
    comp("paged", "allocator", options_type=PagedOptions, capabilities={"content_hash": True}),
    comp("torch", "attention", capabilities={"devices": ("cpu", "cuda"), "phases": ("prefill", "decode")}),
    comp("none", "quantizer", capabilities={"kv_cache_dtype": None}),
    comp("none", "speculator"),
    comp("none", "cache"),
    comp("single", "parallel"),
]


def registry(*extra: Component) -> Registry:
    reg = Registry()
    for c in (*BASE, *extra):
        reg.add(c)
    return reg


def blocks_quantizer(rank: int = 20, check=None, **caps) -> Component:
    """A quantizer that serves GGUF blocks as stored on a CPU (lmstack-gguf's shape)."""
    capabilities = {
        "devices": ("cpu",),
        "dtypes": ("float32",),
        "checkpoint_formats": (GGUF,),
        "auto_rank": {GGUF: {"cpu": rank}},
        **caps,
    }
    return comp("blocks", "quantizer", capabilities=capabilities, check=check)


# Reads dense and GGUF checkpoints by quantizing them at load: never auto's choice over `none`.
LOSSY = comp("lossy", "quantizer", capabilities={"checkpoint_formats": (DENSE, GGUF)})
INT4_READER = comp(
    "int4-reader",
    "quantizer",
    capabilities={"checkpoint_formats": (CT_PACK_QUANTIZED,), "auto_rank": {CT_PACK_QUANTIZED: {"cpu": 5}}},
)
PREFIX = comp(
    "prefix",
    "cache",
    capabilities={"devices": ("cpu", "cuda"), "auto_rank": {"cpu": 10, "cuda": 10}},
    requires={"allocator.content_hash": True},
)


@pytest.fixture
def gguf_model(tmp_path: Path) -> str:
    """A path that resolves as a GGUF checkpoint (its format is known from the name; the
    resolver reads no byte of it)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    return str(path)


# ---------------------------------------------------------------------------------------------
# The defaults are autos
# ---------------------------------------------------------------------------------------------


def test_an_empty_stack_is_all_auto():
    stack = load_stack({})
    assert stack.device == "auto"
    assert stack.quant == {"weights": "auto", "kv_cache": "auto"}
    assert stack.attention == {"prefill": {"name": "auto"}, "decode": {"name": "auto"}}
    assert stack.cache == {"name": "auto"}
    # One phase named: the other stays auto.
    assert load_stack({"attention": {"prefill": "torch"}}).attention["decode"] == {"name": "auto"}
    assert PagedOptions().kv_cache_memory == "auto"


def test_device_auto_takes_cuda_where_torch_sees_it(monkeypatch):
    r = resolve(load_stack({}), registry())
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert r.device.type == want and r.auto_reasons["device"].startswith(f"auto: {want}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # (dtype: auto asks)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (68 * GiB, 80 * GiB))
    r = resolve(load_stack({}), registry(), check_device=False)
    assert r.device == CUDA
    assert r.auto_reasons["device"] == "auto: cuda (torch sees 2 CUDA device(s))"
    assert "80.0 GiB less the 12.0 GiB in use" in r.auto_reasons["kv_cache_memory"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # A GPU stack checked where there is none: the rule alone.
    r = resolve(load_stack({"device": "cuda"}), registry(), check_device=False)
    assert r.auto_reasons["kv_cache_memory"].endswith("(measured there: no CUDA device here)")
    r = resolve(load_stack({}), registry())
    assert r.device == CPU and r.auto_reasons["device"] == "auto: cpu (torch sees no CUDA device)"
    # Named: no reason to give.
    assert "device" not in resolve(load_stack({"device": "cpu"}), registry()).auto_reasons


def test_a_device_that_is_not_one_still_names_auto():
    with pytest.raises(ConfigError, match="expected auto, or e.g. cpu"):
        load_stack({"device": "gpu"})


# ---------------------------------------------------------------------------------------------
# quant.weights: auto
# ---------------------------------------------------------------------------------------------


def test_quantizer_ranking_serves_a_checkpoint_as_stored_fastest_first():
    reg = registry(blocks_quantizer(), LOSSY, INT4_READER)
    # GGUF on a CPU: the blocks as stored, then dequantized (`none`); never the lossy reader.
    assert auto_quantizer_ranking(reg, GGUF, CPU) == ["blocks", "none"]
    # The blocks quantizer runs on CPUs only; a dense checkpoint is never quantized by auto.
    assert auto_quantizer_ranking(reg, GGUF, CUDA) == ["none"]
    assert auto_quantizer_ranking(reg, DENSE, CPU) == ["none"]
    # A format `none` cannot read: its readers (the one ranked for it first).
    assert auto_quantizer_ranking(reg, CT_PACK_QUANTIZED, CPU) == ["int4-reader"]
    assert auto_quantizer(reg, GGUF, CPU) == "blocks"
    with pytest.raises(ResolutionError, match="no installed quantizer reads compressed-tensors/nvfp4"):
        auto_quantizer(reg, "compressed-tensors/nvfp4-pack-quantized")


def test_quant_auto_picks_the_blocks_on_a_cpu_and_says_why(gguf_model):
    r = resolve(load_stack({"model": gguf_model, "device": "cpu"}), registry(blocks_quantizer(), LOSSY))
    assert r.quantizer.name == "blocks"
    assert r.auto_reasons["quantizer"] == "auto for a gguf checkpoint on cpu (ranked: blocks, none): blocks"
    # dtype: auto follows it (it computes in float32).
    assert r.dtype == torch.float32
    # Named: no reason.
    named = resolve(
        load_stack({"model": gguf_model, "device": "cpu", "quant": "none"}), registry(blocks_quantizer())
    )
    assert named.quantizer.name == "none" and "quantizer" not in named.auto_reasons


def test_quant_auto_falls_back_when_the_best_does_not_fit(gguf_model):
    broken = blocks_quantizer(
        check=lambda options, stack, key: f"its kernels do not build here; set {key}: none"
    )
    r = resolve(load_stack({"model": gguf_model, "device": "cpu"}), registry(broken))
    assert r.quantizer.name == "none"
    assert r.auto_reasons["quantizer"] == (
        "auto for a gguf checkpoint on cpu (ranked: blocks, none): none; "
        "skipped blocks its kernels do not build here; set quant.weights: none"
    )
    # An explicit dtype it does not take: the next one.
    r = resolve(
        load_stack({"model": gguf_model, "device": "cpu", "dtype": "bfloat16"}), registry(blocks_quantizer())
    )
    assert r.quantizer.name == "none" and r.dtype == torch.bfloat16
    assert r.auto_reasons["quantizer"].endswith("skipped blocks does not take bfloat16")


class BlocksOptions(msgspec.Struct, forbid_unknown_fields=True):
    activations: str = "int8"


def test_quant_auto_passes_the_options_given_to_the_candidates_that_take_them(gguf_model):
    blocks = blocks_quantizer()
    blocks = comp("blocks", "quantizer", capabilities=blocks.capabilities, options_type=BlocksOptions)
    stack = {"model": gguf_model, "device": "cpu", "quant": {"activations": "fp32"}}
    r = resolve(load_stack(stack), registry(blocks))
    assert r.quantizer.name == "blocks" and r.quantizer.options == BlocksOptions("fp32")
    assert r.auto_reasons["quantizer"] == (
        "auto for a gguf checkpoint on cpu (ranked: blocks): blocks; skipped none does not take activations"
    )
    # No candidate takes them: the first one's error.
    with pytest.raises(ConfigError, match="quant.colour: unknown key; quantizer 'blocks'"):
        resolve(load_stack({**stack, "quant": {"colour": "red"}}), registry(blocks))


def test_quant_auto_declarations_of_the_installed_quantizers():
    """The in-tree quantizers rank only formats they serve as published."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    reg = build_registry(make_plugin_manager())
    names = reg.names("quantizer")
    if "gguf" in names:
        assert auto_quantizer_ranking(reg, GGUF, CPU)[0] == "gguf"
        assert "gguf" not in auto_quantizer_ranking(reg, GGUF, CUDA)
    assert auto_quantizer_ranking(reg, DENSE, CPU)[0] == "none"
    assert auto_quantizer_ranking(reg, DENSE, CUDA)[0] == "none"
    if "awq" in names:
        assert auto_quantizer_ranking(reg, CT_PACK_QUANTIZED, CUDA)[0] == "awq"


# ---------------------------------------------------------------------------------------------
# attention: auto and cache: auto
# ---------------------------------------------------------------------------------------------


def test_attention_auto_is_the_default():
    fast = comp(
        "fast",
        "attention",
        capabilities={"devices": ("cpu",), "phases": ("prefill", "decode"), "auto_rank": {"cpu": 10}},
    )
    r = resolve(load_stack({"device": "cpu"}), registry(fast))
    assert r.attention_prefill.name == r.attention_decode.name == "fast"
    assert r.auto_reasons["attention_decode"] == "auto on cpu (ranked: fast, torch): fast"


def test_cache_auto_takes_prefix_caching_where_installed():
    r = resolve(load_stack({"device": "cpu"}), registry(PREFIX))
    assert r.cache.name == "prefix"
    assert r.auto_reasons["cache"] == "auto on cpu (ranked: prefix, none): prefix"
    r = resolve(load_stack({"device": "cpu"}), registry())
    assert r.cache.name == "none" and r.auto_reasons["cache"] == "auto on cpu (ranked: none): none"
    assert resolve(load_stack({"cache": "none"}), registry(PREFIX)).cache.name == "none"


def test_cache_auto_skips_a_cache_the_allocator_cannot_serve():
    plain = comp("plain", "allocator", capabilities={"content_hash": False})
    r = resolve(load_stack({"device": "cpu", "allocator": "plain"}), registry(PREFIX, plain))
    assert r.cache.name == "none"
    assert r.auto_reasons["cache"].endswith(
        "skipped prefix needs allocator.name with content_hash=True (plain has False)"
    )


def test_cache_auto_takes_no_options():
    with pytest.raises(ConfigError, match="auto takes no options \\(got max_blocks\\)"):
        resolve(load_stack({"cache": {"max_blocks": 8}}), registry(PREFIX))


# ---------------------------------------------------------------------------------------------
# allocator.kv_cache_memory: auto
# ---------------------------------------------------------------------------------------------


def test_kv_budget_on_a_gpu_is_its_fraction_less_what_is_in_use():
    # 80 GiB GPU, 12 GiB in use (weights, context): 0.9 * 80 - 12 = 60 GiB.
    b = kv_budget_from("cuda", free=68 * GiB, total=80 * GiB)
    assert b.bytes == int(0.9 * 80 * GiB) - 12 * GiB
    assert b.reason == (
        "auto on cuda: 90% of the GPU's 80.0 GiB less the 12.0 GiB in use (by the weights once loaded, "
        "and any other process) = 60.0 GiB"
    )
    # More than the fraction in use: nothing (the allocator then says no block fits).
    assert kv_budget_from("cuda", free=4 * GiB, total=80 * GiB).bytes == 0


def test_kv_budget_on_a_cpu_is_a_quarter_of_available_memory_capped():
    assert kv_budget_from("cpu", free=2 * GiB, total=None).bytes == GiB // 2
    b = kv_budget_from("cpu", free=64 * GiB, total=None)
    assert b.bytes == CPU_KV_CAP == GiB
    assert b.reason == "auto on cpu: 25% of the 64.0 GiB available, at most 1.0 GiB = 1.0 GiB"
    assert kv_budget_from("cpu", free=None, total=None).bytes == CPU_KV_CAP


def test_the_paged_allocator_sizes_auto_from_the_budget(monkeypatch):
    from lmstack.model.config import ModelConfig

    mc = ModelConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    monkeypatch.setattr(hardware, "host_available_memory", lambda: 64 * 2**20)  # 64 MiB available
    ctx = BuildContext(mc, CPU, torch.float32, torch.float32)
    per_block = CPU_BLOCK_SIZE * mc.kv_bytes_per_token(4)  # block_size auto on a CPU
    allocator = build_paged(PagedOptions(), ctx)
    assert (allocator.block_size, allocator.num_blocks) == (
        CPU_BLOCK_SIZE,
        (16 * 2**20) // per_block,
    )  # a quarter
    assert build_paged(PagedOptions(kv_cache_memory="1MiB"), ctx).num_blocks == 2**20 // per_block
    monkeypatch.setattr(hardware, "host_available_memory", lambda: 1024)
    with pytest.raises(
        ConfigError, match=r"auto \(auto on cpu: 25% of the 0.0 GiB available.*holds no block"
    ):
        build_paged(PagedOptions(), ctx)


def test_block_size_auto_is_a_number_once_resolved():
    # A CPU's decode reads fewer, longer runs of K/V with larger blocks; GPUs keep vLLM's 16.
    assert (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE) == (64, 16)
    assert PagedOptions().block_size == "auto"
    r = resolve(load_stack({"device": "cpu"}), registry())
    assert r.block_size == CPU_BLOCK_SIZE and r.allocator.options.block_size == CPU_BLOCK_SIZE
    assert r.auto_reasons["block_size"].startswith("auto on cpu: 64")
    assert auto_block_size(torch.device("cuda"))[0] == GPU_BLOCK_SIZE
    # The number is there before candidates are weighed: an auto candidate's check reads it.
    seen = []
    weighed = comp(
        "weighed",
        "cache",
        capabilities={"devices": ("cpu",), "auto_rank": {"cpu": 10}},
        check=lambda options, stack, key: seen.append(stack.block_size),
    )
    resolve(load_stack({"device": "cpu"}), registry(weighed))
    assert seen and set(seen) == {CPU_BLOCK_SIZE}
    # Unresolved options (a plugin's kit builds them directly): the same rule; none set: 16.
    assert block_size_of(PagedOptions(), torch.device("cpu")) == CPU_BLOCK_SIZE
    assert block_size_of(PagedOptions(block_size=32), torch.device("cpu")) == 32
    assert block_size_of(object(), torch.device("cpu")) == 16
    # A number set in the stack is kept, with no reason to state.
    r = resolve(load_stack({"device": "cpu", "allocator": {"name": "paged", "block_size": 16}}), registry())
    assert r.block_size == 16 and "block_size" not in r.auto_reasons
    with pytest.raises(ConfigError, match=r"must be in \[1, 1024\], got 0"):
        PagedOptions(block_size=0)


def test_resolve_states_the_kv_cache_memory_rule():
    r = resolve(load_stack({"device": "cpu"}), registry())
    assert r.auto_reasons["kv_cache_memory"].startswith("auto on cpu: 25% of the ")
    assert r.auto_reasons["kv_cache_memory"].endswith("now (measured again once the weights are loaded)")
    sized = resolve(load_stack({"device": "cpu", "allocator": {"kv_cache_memory": "1GiB"}}), registry())
    assert "kv_cache_memory" not in sized.auto_reasons


# ---------------------------------------------------------------------------------------------
# With the installed plugins: the model alone is the fast CPU stack
# ---------------------------------------------------------------------------------------------

# examples/stacks/cpu.yaml before the defaults became autos: what `make serve` served (with the
# absent cache section spelt out as what it meant then).
HAND_WRITTEN_CPU_STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "auto",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
    "attention": "auto",
    "quant": {"weights": "gguf", "activations": "int8", "kv_cache": "bfloat16"},
    "speculator": {"name": "none"},
    "parallel": {"name": "single"},
    "cache": {"name": "none"},
}


def _components(r) -> dict[str, tuple[str, dict]]:
    return {role: (sel.name, msgspec.to_builtins(sel.options)) for role, sel in r.roles().items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stack: on a machine without CUDA")
def test_the_model_alone_resolves_to_the_hand_written_cpu_stack(smollm2_path):
    pytest.importorskip("lmstack_gguf")
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    reg = build_registry(make_plugin_manager())
    alone = resolve(load_stack({"model": "smollm2-135m-instruct"}), reg)
    example = resolve(load_stack(ROOT / "examples" / "stacks" / "cpu.yaml"), reg)
    old = resolve(load_stack(HAND_WRITTEN_CPU_STACK), reg)
    assert _components(alone) == _components(example)
    assert (alone.device, alone.dtype, alone.kv_cache_dtype) == (
        example.device,
        example.dtype,
        example.kv_cache_dtype,
    )
    # Against the old file: the same components and options, but for the three new autos
    # (the KV budget is measured; blocks of 64 tokens on a CPU; prefix caching is on where installed).
    want, got = _components(old), _components(alone)
    assert got["allocator"][1].pop("block_size") == CPU_BLOCK_SIZE
    assert want["allocator"][1].pop("block_size") == 16
    assert got["allocator"][1].pop("kv_cache_memory") == "auto"
    assert want["allocator"][1].pop("kv_cache_memory") == "1GiB"
    expected_cache = "prefix" if "prefix" in reg.names("cache") else "none"
    assert got.pop("cache")[0] == expected_cache and want.pop("cache")[0] == "none"
    assert got == want
    assert (alone.device, alone.dtype, alone.kv_cache_dtype) == (old.device, old.dtype, old.kv_cache_dtype)
    assert alone.quantizer.name == "gguf" and alone.kv_cache_dtype == torch.bfloat16


def test_prefix_caching_on_by_default_gives_the_same_greedy_tokens(tiny_model_path):
    pytest.importorskip("lmstack_prefix_cache")
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager
    from lmstack.testing.kit import greedy, tiny_stack

    shared = "the cat sat on the mat and the dog sat on the log, " * 3
    prompts = [shared + "then", shared + "and so", shared + "then"]
    llms = {}
    try:
        for cache in ("auto", "none"):
            stack = tiny_stack(tiny_model_path, cache={"name": cache})
            llms[cache] = LLM(stack, plugin_manager=make_plugin_manager())
        assert llms["auto"].engine.stack.cache.name == "prefix"
        outs = {}
        for cache, llm in llms.items():
            greedy(llm, prompts[:1], 12)  # the shared prefix is computed (and cached) once
            outs[cache] = greedy(llm, prompts, 12)
        for with_cache, without in zip(outs["auto"], outs["none"], strict=True):
            assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids
        assert all(o.num_cached_tokens > 0 for o in outs["auto"]), "the prefix cache was not hit"
        assert all(o.num_cached_tokens == 0 for o in outs["none"])
    finally:
        for llm in llms.values():
            llm.engine.shutdown()
