"""Resolving a stack against the installed components: lookup, options, capability conflicts."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from lmstack.errors import ConfigError, ResolutionError
from lmstack.kernels.hardware import auto_dtype
from lmstack.model.config import ModelConfig
from lmstack.registry import Component, Registry
from lmstack.stack.config import StackConfig, load_stack
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import ResolvedStack, Selected, check_model, resolve

# ---------------------------------------------------------------------------------------------
# A fake world of components (no built-ins, nothing installed)
# ---------------------------------------------------------------------------------------------


class SchedOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: int = 8
    chunked_prefill: bool = True


class AllocOptions(msgspec.Struct, forbid_unknown_fields=True):
    block_size: int = 16


class LayoutOptions(msgspec.Struct, forbid_unknown_fields=True):
    tp: int = 1
    pp: int = 1
    ep: int = 1


class SpecOptions(msgspec.Struct, forbid_unknown_fields=True):
    num_draft_tokens: int = 4


def comp(name: str, kind: str, dist: str = "lmstack-fake", **kw) -> Component:
    return Component(name=name, kind=kind, factory=lambda o, c: None, distribution=dist, version="1.0", **kw)


BASE = [
    comp("continuous", "scheduler", options_type=SchedOptions, capabilities={"chunked_prefill": True}),
    comp("paged", "allocator", options_type=AllocOptions),
    comp("torch", "attention", capabilities={"devices": ("cpu", "cuda"), "phases": ("prefill", "decode")}),
    comp("none", "quantizer", capabilities={"kv_cache_dtype": None}),
    comp("none", "speculator"),
    comp("none", "cache"),
    comp("single", "parallel"),  # last: a test replaces it
]


def registry(*extra: Component) -> Registry:
    reg = Registry()
    for c in (*BASE, *extra):
        reg.add(c)
    return reg


def resolved(stack: dict, *extra: Component) -> ResolvedStack:
    return resolve(load_stack(stack), registry(*extra))


def conflict(stack: dict, *extra: Component) -> str:
    with pytest.raises(ResolutionError) as info:
        resolved(stack, *extra)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def model_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return ModelConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------------
# Lookup and options
# ---------------------------------------------------------------------------------------------


def test_default_stack_resolves():
    r = resolved({})
    assert r.model == "smollm2-135m-instruct"
    assert r.device == torch.device("cpu")
    # dtype: auto (the default): whatever this CPU computes best, and the KV cache follows it.
    assert r.dtype is auto_dtype(torch.device("cpu")).dtype and r.kv_cache_dtype is r.dtype
    assert r.scheduler.component.name == "continuous"
    assert r.scheduler.options == SchedOptions()
    assert r.attention_prefill.name == r.attention_decode.name == "torch"
    assert r.parallel.name == "single"
    assert r.chunked_prefill is True
    assert r.block_size == 16
    assert set(r.roles()) == {
        "scheduler",
        "allocator",
        "attention_prefill",
        "attention_decode",
        "quantizer",
        "speculator",
        "parallel",
        "cache",
    }
    assert all(isinstance(s, Selected) for s in r.roles().values())


def test_describe_is_json():
    r = resolved({"dtype": "float32", "scheduler": {"max_num_seqs": 3}})
    out = json.loads(json.dumps(r.describe()))
    assert out["dtype"] == "float32" and out["kv_cache_dtype"] == "float32"
    sched = out["components"]["scheduler"]
    assert sched == {
        "name": "continuous",
        "kind": "scheduler",
        "distribution": "lmstack-fake",
        "version": "1.0",
        "options": {"max_num_seqs": 3, "chunked_prefill": True},
        "capabilities": {"chunked_prefill": True},
        "requires": {},
    }
    assert out["components"]["attention_prefill"]["capabilities"]["devices"] == ["cpu", "cuda"]


def test_options_are_converted_to_the_component_options_type():
    r = resolved(
        {"allocator": {"block_size": 32}, "scheduler": {"name": "continuous", "chunked_prefill": False}}
    )
    assert r.allocator.options == AllocOptions(block_size=32)
    assert r.scheduler.options == SchedOptions(chunked_prefill=False)
    assert r.chunked_prefill is False


def test_unknown_component_lists_the_installed_ones():
    msg = conflict({"scheduler": {"name": "fair-share"}}, comp("priority", "scheduler"))
    assert msg.startswith("scheduler.name: unknown scheduler 'fair-share'")
    assert "continuous, priority" in msg
    msg = conflict({"attention": {"prefill": "flash"}})
    assert msg.startswith("attention.prefill.name: unknown attention 'flash'") and "torch" in msg
    msg = conflict({"quant": "awq"})
    assert msg.startswith("quant.weights: unknown quantizer 'awq'")


@pytest.mark.parametrize(
    ("stack", "path", "fragment"),
    [
        ({"allocator": {"block_size": "big"}}, "allocator.block_size", "expected int, got str"),
        (
            {"allocator": {"blocksize": 16}},
            "allocator.blocksize",
            "allocator 'paged' (lmstack-fake) accepts: block_size",
        ),
        ({"scheduler": {"max_num_seqs": 1.5}}, "scheduler.max_num_seqs", "expected int"),
        (
            {"quant": {"group_size": 64}},
            "quant.group_size",
            "quantizer 'none' (lmstack-fake) takes no options",
        ),
        (
            {"attention": {"decode": {"name": "torch", "warps": 4}}},
            "attention.decode.warps",
            "takes no options",
        ),
        ({"parallel": {"tp": 0}}, "parallel.tp", "positive integer"),
    ],
)
def test_bad_options_name_the_path(stack, path, fragment):
    with pytest.raises(ConfigError) as info:
        resolved(stack)
    assert info.value.path == path
    assert fragment in str(info.value)


def test_a_stack_config_built_in_code_may_use_short_forms():
    r = resolve(StackConfig(attention="torch", scheduler={"max_num_seqs": 2}), registry())  # type: ignore[arg-type]
    assert r.attention_decode.name == "torch" and r.scheduler.options.max_num_seqs == 2


# ---------------------------------------------------------------------------------------------
# KV-cache dtype
# ---------------------------------------------------------------------------------------------

FP8 = comp("fp8", "quantizer", dist="lmstack-fp8", capabilities={"kv_cache_dtype": "float8_e4m3fn"})


def test_kv_cache_dtype_follows_the_quantizer_unless_overridden():
    assert resolved({"quant": "fp8"}, FP8).kv_cache_dtype is torch.float8_e4m3fn
    assert resolved({"quant": {"weights": "fp8", "kv_cache": "float16"}}, FP8).kv_cache_dtype is torch.float16
    none = {"dtype": "bfloat16", "quant": {"weights": "fp8", "kv_cache": "none"}}
    assert resolved(none, FP8).kv_cache_dtype is torch.bfloat16
    assert resolved({"dtype": "float16"}).kv_cache_dtype is torch.float16


def test_quantizer_kv_dtype_against_kernel_names_both():
    strict = comp(
        "bf16-only", "attention", dist="lmstack-bf16", capabilities={"kv_cache_dtypes": ("bfloat16",)}
    )
    msg = conflict({"quant": "fp8", "attention": "bf16-only"}, FP8, strict)
    assert "prefill kernel 'bf16-only' (lmstack-bf16 1.0)" in msg
    assert "quantizer 'fp8' (lmstack-fp8 1.0)" in msg
    assert "quant.kv_cache" in msg  # the way out
    assert "installed ones that fit: torch" in msg


def test_fp8_kv_cache_spelling_and_a_kernel_that_cannot_read_it():
    assert resolved({"quant": {"kv_cache": "fp8_e4m3"}}).kv_cache_dtype is torch.float8_e4m3fn
    assert resolved({"quant": {"kv_cache": "float8_e4m3fn"}}).kv_cache_dtype is torch.float8_e4m3fn
    strict = comp(
        "bf16-only", "attention", dist="lmstack-bf16", capabilities={"kv_cache_dtypes": ("bfloat16",)}
    )
    msg = conflict({"quant": {"kv_cache": "fp8_e4m3"}, "attention": "bf16-only"}, strict)
    assert "prefill kernel 'bf16-only' (lmstack-bf16 1.0) reads KV caches in bfloat16 only" in msg
    assert "quant.kv_cache: float8_e4m3fn" in msg
    assert "set quant.kv_cache to one of bfloat16" in msg and "fit: torch" in msg


# ---------------------------------------------------------------------------------------------
# Capability conflicts: each names both sides and the way out
# ---------------------------------------------------------------------------------------------


def test_device_conflict():
    gpu = comp("flash", "attention", dist="lmstack-flash-attention", capabilities={"devices": ("cuda",)})
    msg = conflict({"attention": {"prefill": "flash"}}, gpu)
    assert "prefill kernel 'flash' (lmstack-flash-attention 1.0) runs on cuda only" in msg
    assert "device: cpu" in msg and "attention.prefill" in msg and "torch" in msg


class OptInOptions(msgspec.Struct, forbid_unknown_fields=True):
    emulate: bool = False


def _opt_in_kernel(**kw) -> Component:
    return comp(
        "emulated",
        "attention",
        options_type=OptInOptions,
        capabilities={"devices": ("cuda",)},
        capabilities_for=lambda o: {"devices": ("cuda", "cpu")} if o.emulate else {"devices": ("cuda",)},
        **kw,
    )


def test_capabilities_may_depend_on_options():
    kernel = _opt_in_kernel()
    assert "runs on cuda only" in conflict({"attention": "emulated"}, kernel)
    r = resolved({"attention": {"name": "emulated", "emulate": True}}, kernel)
    assert r.attention_prefill.capabilities == {"devices": ("cuda", "cpu")}
    assert r.describe()["components"]["attention_decode"]["capabilities"]["devices"] == ("cuda", "cpu")
    # The static capabilities (what `lmstack plugins` lists, what "fits" hints use) stay as declared.
    assert kernel.capabilities == {"devices": ("cuda",)}


def test_a_component_check_speaks_first_and_in_its_own_words():
    def check(options, stack, key):
        if stack.device.type != "cuda" and not options.emulate:
            return f"needs CUDA, but the stack sets device: {stack.device}; set {key}: torch"
        return None

    kernel = _opt_in_kernel(check=check)
    msg = conflict({"attention": {"decode": "emulated"}}, kernel)
    assert msg == (
        "decode kernel 'emulated' (lmstack-fake 1.0) needs CUDA, but the stack sets device: cpu; "
        "set attention.decode: torch"
    )
    assert (
        resolved({"attention": {"name": "emulated", "emulate": True}}, kernel).attention_decode.name
        == "emulated"
    )


def test_model_dtype_conflict():
    fp16 = comp("fp16-kernel", "attention", capabilities={"dtypes": ("float16",)})
    msg = conflict({"attention": "fp16-kernel", "dtype": "bfloat16"}, fp16)
    assert "'fp16-kernel'" in msg and "dtype: bfloat16" in msg and "float16" in msg


def test_auto_dtype_takes_the_next_best_dtype_the_components_accept():
    fp16 = comp("fp16-kernel", "attention", capabilities={"dtypes": ("float16",)})
    r = resolved({"attention": "fp16-kernel"}, fp16)
    assert r.dtype is torch.float16
    assert "fp16-kernel does not take" in r.dtype_reason and r.dtype_reason.startswith("auto:")
    assert (
        resolved({"attention": "fp16-kernel", "dtype": "float16"}, fp16).attention_prefill.name
        == "fp16-kernel"
    )


def test_auto_dtype_takes_the_quantizers_choice_for_the_device(monkeypatch):
    from lmstack.kernels import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    caps = {"auto_dtypes": {"cpu": "float32"}, "auto_dtypes_reason": "its kernel computes in float32"}
    picky = comp("picky", "quantizer", capabilities=caps)
    r = resolved({"quant": {"weights": "picky"}}, picky)
    assert (
        r.dtype is torch.float32 and r.dtype_reason == "auto: float32 on cpu (its kernel computes in float32)"
    )
    assert resolved({"quant": {"weights": "picky"}, "dtype": "bfloat16"}, picky).dtype is torch.bfloat16
    # Not where a component refuses it: then the usual order.
    bf16_only = comp("bf16-kernel", "attention", capabilities={"dtypes": ("bfloat16",)})
    r = resolved({"quant": {"weights": "picky"}, "attention": "bf16-kernel"}, picky, bf16_only)
    assert r.dtype is torch.bfloat16


def test_auto_dtype_is_float32_with_a_speculator_on_a_bf16_cpu(monkeypatch):
    """bf16 verification rows round unlike plain decoding's single rows (greedy output measured
    to drift on an Intel Xeon with AMX): with a speculator, auto picks float32 on a CPU, says why,
    and `lmstack check` warns about an explicit 16-bit dtype with a speculator."""
    from lmstack.kernels import hardware
    from lmstack.stack.resolve import speculation_warning

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    ngram = comp("ngram", "speculator", dist="lmstack-ngram", options_type=SpecOptions)
    plain = resolved({})
    assert plain.dtype is torch.bfloat16 and speculation_warning(plain) is None
    r = resolved({"speculator": "ngram"}, ngram)
    assert r.dtype is torch.float32
    assert r.dtype_reason.startswith("auto: float32 on cpu with the ngram speculator (not bfloat16)")
    assert speculation_warning(r) is None
    explicit = resolved({"speculator": "ngram", "dtype": "bfloat16"}, ngram)
    assert explicit.dtype is torch.bfloat16
    assert "greedy output may differ" in speculation_warning(explicit)
    # A component that cannot take float32 keeps the usual order.
    bf16_only = comp("bf16-kernel", "attention", capabilities={"dtypes": ("bfloat16",)})
    assert (
        resolved({"speculator": "ngram", "attention": "bf16-kernel"}, ngram, bf16_only).dtype
        is torch.bfloat16
    )


def test_kernel_used_for_a_phase_it_lacks():
    decode_only = comp("paged-decode", "attention", capabilities={"phases": ("decode",)})
    assert (
        resolved({"attention": {"decode": "paged-decode"}}, decode_only).attention_decode.name
        == "paged-decode"
    )
    msg = conflict({"attention": "paged-decode"}, decode_only)
    assert "'paged-decode'" in msg and "handles only decode" in msg and "attention.prefill" in msg


def test_chunked_prefill_needs_a_kernel_with_chunked_context():
    naive = comp("naive", "attention", dist="lmstack-naive", capabilities={"chunked_context": False})
    msg = conflict({"attention": {"prefill": "naive"}}, naive)
    assert "scheduler 'continuous' (lmstack-fake 1.0) does chunked prefill" in msg
    assert "prefill kernel 'naive' (lmstack-naive 1.0)" in msg
    assert "scheduler.chunked_prefill: false" in msg
    # Turning chunked prefill off is the way out.
    r = resolved({"attention": {"prefill": "naive"}, "scheduler": {"chunked_prefill": False}}, naive)
    assert r.attention_prefill.name == "naive"
    # The decode kernel never needs it.
    assert resolved({"attention": {"decode": "naive"}}, naive).attention_decode.name == "naive"


def test_any_speculator_needs_chunked_context():
    naive = comp("naive", "attention", capabilities={"chunked_context": False})
    ngram = comp("ngram", "speculator", dist="lmstack-ngram", options_type=SpecOptions)
    stack = {
        "attention": {"prefill": "naive"},
        "scheduler": {"chunked_prefill": False},
        "speculator": "ngram",
    }
    msg = conflict(stack, naive, ngram)
    assert "speculator 'ngram' (lmstack-ngram 1.0)" in msg and "'naive'" in msg and "speculator: none" in msg


def test_explicit_requirement_on_another_role():
    eagle = comp("eagle", "speculator", dist="lmstack-eagle", requires={"scheduler.chunked_prefill": True})
    assert resolved({"speculator": "eagle"}, eagle).speculator.name == "eagle"
    msg = conflict({"speculator": "eagle", "scheduler": {"chunked_prefill": False}}, eagle)
    assert "speculator 'eagle' (lmstack-eagle 1.0) needs a scheduler with chunked_prefill=True" in msg
    assert "scheduler 'continuous' (lmstack-fake 1.0) has chunked_prefill=False" in msg


def test_bare_requirement_and_attention_requirement():
    # A bare capability name is looked up in the role that declares it (here: attention, and
    # for chunked_context only the prefill kernel matters).
    needy = comp("needy", "allocator", requires={"chunked_context": True})
    naive = comp("naive", "attention", capabilities={"chunked_context": False, "sliding_window": False})
    stack = {"allocator": "needy", "attention": {"prefill": "naive"}, "scheduler": {"chunked_prefill": False}}
    msg = conflict(stack, needy, naive)
    assert "allocator 'needy'" in msg and "prefill kernel 'naive'" in msg and "chunked_context=True" in msg
    assert resolved({**stack, "attention": {"decode": "naive"}}, needy, naive).allocator.name == "needy"

    windowed = comp("windowed", "quantizer", requires={"attention.sliding_window": True})
    msg = conflict({"quant": "windowed", "attention": {"decode": "naive"}}, windowed, naive)
    assert "quantizer 'windowed'" in msg and "decode kernel 'naive'" in msg


def test_malformed_requirement_names_the_component():
    odd = comp("odd", "allocator", dist="lmstack-odd", requires={"frobnicate": True})
    msg = conflict({"allocator": "odd"}, odd)
    assert "allocator 'odd' (lmstack-odd 1.0)" in msg and "'frobnicate'" in msg


def test_block_size_must_suit_the_kernels():
    b16 = comp("b16", "attention", capabilities={"block_sizes": (16,)})
    assert resolved({"attention": "b16"}, b16).block_size == 16
    msg = conflict({"attention": "b16", "allocator": {"block_size": 32}}, b16)
    assert "'b16'" in msg and "allocator 'paged'" in msg and "block_size 32" in msg


def test_single_layout_rejects_sharding():
    msg = conflict({"parallel": {"tp": 2}})
    assert msg.startswith("parallel.tp: tp=2")
    assert "'single'" in msg and "install a parallel plugin" in msg
    # tp/pp/ep of 1 are accepted by a layout without options.
    assert resolved({"parallel": {"tp": 1, "pp": 1, "ep": 1}}).parallel.name == "single"


def test_single_layout_with_layout_options_rejects_sharding_too():
    reg = Registry()
    for c in BASE[:-1]:
        reg.add(c)
    reg.add(comp("single", "parallel", options_type=LayoutOptions))
    reg.add(comp("tp", "parallel", dist="lmstack-tp", options_type=LayoutOptions))
    with pytest.raises(ResolutionError, match=r"parallel.ep: ep=4 .*installed layouts: tp"):
        resolve(load_stack({"parallel": {"ep": 4}}), reg)
    r = resolve(load_stack({"parallel": {"name": "tp", "tp": 2}}), reg)
    assert r.parallel.options == LayoutOptions(tp=2)


def test_cache_section_selects_a_cache_component():
    assert resolved({}).cache.name == "none"
    assert conflict({"cache": "prefix"}).startswith("cache.name: unknown cache 'prefix'")
    prefix = comp("prefix", "cache", requires={"allocator.content_hash": True})
    assert resolved({"cache": {"name": "prefix"}}, prefix).cache.name == "prefix"
    msg = conflict(
        {"cache": "prefix", "allocator": "plain"},
        prefix,
        comp("plain", "allocator", capabilities={"content_hash": False}),
    )
    assert "needs a allocator with content_hash=True" in msg and "allocator.name" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_absent_device_is_reported_unless_skipped():
    msg = conflict({"device": "cuda"})
    assert "device: cuda is not available" in msg
    assert resolve(load_stack({"device": "cuda"}), registry(), check_device=False).device.type == "cuda"


# ---------------------------------------------------------------------------------------------
# check_model
# ---------------------------------------------------------------------------------------------


def test_check_model_accepts_a_fitting_model():
    check_model(resolved({}), model_config())


def test_check_model_head_dim():
    small = comp("small-heads", "attention", dist="lmstack-small", capabilities={"head_dims": (64, 128)})
    r = resolved({"attention": {"decode": "small-heads"}}, small)
    check_model(r, model_config(head_dim=64))
    with pytest.raises(ResolutionError) as info:
        check_model(r, model_config(head_dim=80))
    msg = str(info.value)
    assert (
        "decode kernel 'small-heads' (lmstack-small 1.0)" in msg and "head_dim 80" in msg and "64, 128" in msg
    )


def test_check_model_sliding_window():
    no_window = comp("no-window", "attention", capabilities={"sliding_window": False})
    r = resolved({"attention": "no-window"}, no_window)
    check_model(r, model_config())
    with pytest.raises(ResolutionError, match=r"'no-window'.*sliding-window.*4096-token"):
        check_model(r, model_config(sliding_window=4096))


def test_check_model_max_model_len():
    check_model(resolved({"max_model_len": 512}), model_config())
    with pytest.raises(ConfigError) as info:
        check_model(resolved({"max_model_len": 4096}), model_config())
    assert info.value.path == "max_model_len" and "512" in str(info.value)
    # RoPE scaling extends the context: allowed.
    check_model(
        resolved({"max_model_len": 4096}), model_config(rope_scaling={"rope_type": "linear", "factor": 8.0})
    )


# ---------------------------------------------------------------------------------------------
# With the real built-ins
# ---------------------------------------------------------------------------------------------


def test_the_builtin_defaults_resolve(monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    r = resolve(load_stack({}), build_registry(make_plugin_manager()))
    assert {role: s.name for role, s in r.roles().items()} == {
        "scheduler": "continuous",
        "allocator": "paged",
        "attention_prefill": "torch",
        "attention_decode": "torch",
        "quantizer": "none",
        "speculator": "none",
        "parallel": "single",
        "cache": "none",
    }
    assert all(s.component.distribution == "lmstack" for s in r.roles().values())
    json.dumps(r.describe())


# --- quant.weights: auto and checkpoint formats ----------------------------------------------


def test_auto_quantizer_picks_the_reader_of_the_checkpoint_format():
    from lmstack.quant.formats import CT_PACK_QUANTIZED, DENSE, GGUF
    from lmstack.stack.resolve import auto_quantizer

    reader = Component(
        name="int4-reader",
        kind="quantizer",
        factory=lambda o, c: None,
        capabilities={"checkpoint_formats": (CT_PACK_QUANTIZED,)},
    )
    reg = registry(reader)
    assert auto_quantizer(reg, DENSE) == "none"
    assert auto_quantizer(reg, GGUF) == "none"
    assert auto_quantizer(reg, CT_PACK_QUANTIZED) == "int4-reader"
    with pytest.raises(ResolutionError, match="no installed quantizer reads compressed-tensors/nvfp4"):
        auto_quantizer(reg, "compressed-tensors/nvfp4-pack-quantized")


def test_a_quantizer_that_cannot_read_the_checkpoint_is_a_resolution_error(tiny_model_path):
    import dataclasses

    from lmstack.model.source import open_model_source

    resolved = resolve(load_stack({"model": str(tiny_model_path), "quant": "none"}), registry())
    config = open_model_source(tiny_model_path).config
    check_model(resolved, config)  # dense: fine
    ct = dataclasses.replace(
        config, quantization={"quant_method": "compressed-tensors", "format": "pack-quantized"}
    )
    with pytest.raises(ResolutionError, match="is a compressed-tensors/pack-quantized checkpoint"):
        check_model(resolved, ct)


# ---------------------------------------------------------------------------------------------
# attention: auto
# ---------------------------------------------------------------------------------------------


def _fast(name: str, rank: int, check=None, **caps) -> Component:
    capabilities = {"devices": ("cpu",), "phases": ("prefill", "decode"), "auto_rank": {"cpu": rank}, **caps}
    return comp(name, "attention", capabilities=capabilities, check=check)


def test_attention_auto_picks_the_highest_ranked_backend_that_fits():
    r = resolved(
        {"attention": "auto"},
        _fast("fast", 10),
        _fast("faster", 20),
        _fast("gpu-only", 99, devices=("cuda",)),
    )
    assert r.attention_prefill.name == r.attention_decode.name == "faster"
    assert r.auto_reasons["attention_decode"] == "auto on cpu (ranked: faster, fast, torch): faster"
    assert r.describe()["auto_reasons"] == dict(r.auto_reasons)
    # Only the phase left to auto is chosen; a backend without auto_rank is never picked.
    r = resolved(
        {"attention": {"prefill": "torch", "decode": "auto"}}, _fast("fast", 10), comp("plain", "attention")
    )
    assert (r.attention_prefill.name, r.attention_decode.name) == ("torch", "fast")
    assert "attention_decode" in r.auto_reasons and "attention_prefill" not in r.auto_reasons
    # Named everywhere: no auto left to explain.
    named = {"device": "cpu", "attention": "torch", "quant": "none", "cache": "none"}
    assert resolved(named).auto_reasons == {}


def test_attention_auto_skips_a_backend_that_cannot_run_here_and_says_why():
    broken = _fast("native", 20, check=lambda options, stack, key: f"cannot be built here; use {key}: torch")
    r = resolved({"attention": "auto"}, broken, _fast("fp32-only", 10, dtypes=("float32",)))
    expect = "fp32-only" if r.dtype == torch.float32 else "torch"
    assert r.attention_prefill.name == expect
    reason = r.auto_reasons["attention_prefill"]
    assert "skipped native cannot be built here; use attention.prefill: torch" in reason
    r = resolved({"attention": "auto", "dtype": "float16"}, _fast("fp32-only", 10, dtypes=("float32",)))
    assert r.attention_decode.name == "torch"
    assert r.auto_reasons["attention_decode"].endswith("skipped fp32-only does not take float16")


def test_attention_auto_takes_no_options():
    with pytest.raises(ConfigError, match="auto takes no options \\(got isa\\)"):
        resolved({"attention": {"prefill": {"name": "auto", "isa": "avx2"}}}, _fast("fast", 10))
