"""The kits catch what they promise to catch: deliberately wrong components fail them, with a
message naming the problem. Each check is called directly on a kit subclass instance, as
pytest would call it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
import pytest
import torch
from torch import nn

from lmstack.components import continuous, none_quantizer, single, torch_attention
from lmstack.components.continuous import ContinuousScheduler
from lmstack.components.paged import COMPONENT as PAGED
from lmstack.components.paged import PagedAllocator
from lmstack.errors import ConfigError
from lmstack.interfaces import Quantizer, Speculator
from lmstack.model.linear import default_linear
from lmstack.registry import Component, InvalidComponent
from lmstack.testing import (
    AllocatorConformance,
    AttentionConformance,
    ParallelConformance,
    QuantizerConformance,
    SchedulerConformance,
    SpeculatorConformance,
    build_component,
)

pytest_plugins = ["pytester"]


def kit(base: type, component: Component | str, **attrs):
    """An instance of a kit subclass testing `component`, as a plugin's test module writes it."""
    return type(f"Test{base.__name__}", (base,), {"component": component, **attrs})()


# --- building through the registered factory ----------------------------------------------------


def _raising_factory(options, ctx):
    raise FileNotFoundError("draft weights not found at /nowhere")


def test_a_factory_that_raises_fails_every_kit_by_name():
    broken = replace(continuous.COMPONENT, factory=_raising_factory)
    with pytest.raises(
        AssertionError, match=r"scheduler 'continuous'.*factory raised FileNotFoundError: draft"
    ):
        kit(SchedulerConformance, broken).test_registered_component_builds()
    with pytest.raises(AssertionError, match="factory raised"):
        kit(SchedulerConformance, broken).test_all_requests_finish_within_limits()


class NeedsAPath(msgspec.Struct, forbid_unknown_fields=True):
    """Registers fine, but its defaults are invalid: every stack that selects it fails."""

    block_size: int = 16
    draft_weights: str = ""

    def __post_init__(self) -> None:
        if not self.draft_weights:
            raise ConfigError("must name the draft weights file", "speculator.draft_weights")


def test_an_options_type_that_cannot_take_the_kits_options_fails():
    broken = replace(PAGED, options_type=NeedsAPath)
    with pytest.raises(
        AssertionError, match=r"allocator 'paged': options \{\} do not convert to NeedsAPath: .*draft weights"
    ):
        kit(AllocatorConformance, broken).test_registered_component_builds()
    wrong_type = replace(PAGED, options_type=SeqsOptions)
    with pytest.raises(AssertionError, match="do not convert"):
        kit(
            AllocatorConformance, wrong_type, options={"max_num_seqs": "eight"}
        ).test_registered_component_builds()


def test_the_registry_refuses_options_types_the_kits_would_otherwise_have_to_catch():
    with pytest.raises(InvalidComponent, match="options_type must be a msgspec.Struct"):
        replace(PAGED, options_type=DataclassOptions)
    with pytest.raises(InvalidComponent, match="must forbid unknown fields"):
        replace(PAGED, options_type=msgspec.defstruct("Lax", [("x", int, 0)]))


@dataclass
class DataclassOptions:
    block_size: int = 16


class SeqsOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: int = 8


def test_a_factory_returning_the_wrong_kind_is_named():
    wrong = replace(PAGED, factory=lambda o, c: object())
    with pytest.raises(
        AssertionError, match=r"returned a object, which is not an lmstack.interfaces.KVAllocator"
    ):
        build_component(wrong, "allocator")


def test_options_reach_the_factory_converted():
    alloc = build_component("paged", "allocator", {"block_size": 8, "num_blocks": 5})
    assert (alloc.block_size, alloc.num_blocks) == (8, 5)
    with pytest.raises(AssertionError, match="do not convert"):
        build_component("paged", "allocator", {"block_size": "eight"})


# --- declared capabilities are tested, and must be honoured -------------------------------------


class WrongAtHeadDim32(torch_attention.TorchAttention):
    """Correct except at head dim 32, where the last lane of every output is off by 0.05."""

    def decode(self, q, k_cache, v_cache, meta, *, scale, sliding_window):
        out = super().decode(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window)
        if q.shape[-1] == 32:
            out[..., -1] += 0.05
        return out


WRONG_ATTENTION = replace(
    torch_attention.COMPONENT,
    name="wrong",
    factory=lambda o, c: WrongAtHeadDim32(),
    capabilities={**torch_attention.COMPONENT.capabilities, "head_dims": (32, 64), "phases": ("decode",)},
)


def test_attention_kit_tests_every_declared_head_dim_and_catches_a_wrong_one():
    small = {"dtypes": (torch.float32,), "block_sizes": (4,), "gqa_ratios": (2,), "max_len": 40}
    with pytest.raises(AssertionError, match="head_dim 32"):
        kit(AttentionConformance, WRONG_ATTENTION, **small).test_decode()
    # Narrowed to the head dim it computes right, it passes: the failure above is that head dim.
    kit(AttentionConformance, WRONG_ATTENTION, head_dims=(64,), **small).test_decode()


def test_attention_class_attributes_must_stay_within_the_declared_capabilities():
    declared_64 = replace(WRONG_ATTENTION, capabilities={**WRONG_ATTENTION.capabilities, "head_dims": (64,)})
    with pytest.raises(
        AssertionError,
        match=r"head_dims = \(64, 128\) tests \[128\], which attention 'wrong' does not declare",
    ):
        kit(
            AttentionConformance, declared_64, head_dims=(64, 128)
        ).test_class_attributes_within_declared_capabilities()
    with pytest.raises(AssertionError, match="sliding_window = True tests sliding_window"):
        no_window = replace(declared_64, capabilities={**declared_64.capabilities, "sliding_window": False})
        kit(AttentionConformance, no_window, sliding_window=True).test_sliding_window()


class ComputesInCacheDtype(torch_attention.TorchAttention):
    """Rounds the queries to the cache's dtype: fine when they match, lossy under an fp16 cache."""

    def decode(self, q, k_cache, v_cache, meta, *, scale, sliding_window):
        rounded = q.to(k_cache.dtype).to(q.dtype)
        return super().decode(rounded, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window)


def test_attention_kit_reads_caches_in_each_declared_kv_dtype():
    lossy = replace(WRONG_ATTENTION, factory=lambda o, c: ComputesInCacheDtype())
    small = {"head_dims": (64,), "block_sizes": (4,), "gqa_ratios": (2,), "max_len": 40}
    with pytest.raises(AssertionError, match=r"torch.float32 over a torch.float16 cache head_dim 64"):
        kit(AttentionConformance, lossy, **small).test_kv_cache_in_declared_dtypes()
    kit(AttentionConformance, WRONG_ATTENTION, **small).test_kv_cache_in_declared_dtypes()
    fp32_only = replace(lossy, capabilities={**lossy.capabilities, "kv_cache_dtypes": ("float32",)})
    with pytest.raises(pytest.skip.Exception, match="no KV-cache dtype other than torch.float32"):
        kit(AttentionConformance, fp32_only, **small).test_kv_cache_in_declared_dtypes()


class ScalesOfTheWrongHead(torch_attention.TorchAttention):
    """Applies the KV heads' scales in reverse head order (a per-head indexing bug)."""

    def decode(self, q, k_cache, v_cache, meta, *, scale, sliding_window, k_scale=None, v_scale=None):
        return super().decode(
            q,
            k_cache,
            v_cache,
            meta,
            scale=scale,
            sliding_window=sliding_window,
            k_scale=k_scale.flip(0),
            v_scale=v_scale.flip(0),
        )


def test_attention_kit_checks_scaled_fp8_caches_per_head():
    wrong = replace(
        WRONG_ATTENTION,
        factory=lambda o, c: ScalesOfTheWrongHead(),
        capabilities={
            **WRONG_ATTENTION.capabilities,
            "head_dims": (64,),
            "kv_cache_dtypes": ("float8_e4m3fn",),
        },
    )
    small = {"block_sizes": (4,), "gqa_ratios": (2,), "max_len": 40}
    with pytest.raises(AssertionError, match=r"over a scaled torch.float8_e4m3fn cache"):
        kit(AttentionConformance, wrong, **small).test_scaled_fp8_kv_cache()
    right = replace(wrong, factory=lambda o, c: torch_attention.TorchAttention())
    kit(AttentionConformance, right, **small).test_scaled_fp8_kv_cache()
    no_fp8 = replace(right, capabilities={**right.capabilities, "kv_cache_dtypes": ("float32",)})
    with pytest.raises(pytest.skip.Exception, match="declares no float8 KV-cache dtype"):
        kit(AttentionConformance, no_fp8, **small).test_scaled_fp8_kv_cache()


def test_attention_phases_come_from_the_declaration():
    decode_only = kit(AttentionConformance, WRONG_ATTENTION)
    with pytest.raises(pytest.skip.Exception, match="no prefill phase"):
        decode_only.test_prefill_varlen()


def _never_chunks(options, ctx):
    return ContinuousScheduler(
        msgspec.structs.replace(options, chunked_prefill=False), ctx.allocator, ctx.limits
    )


def test_scheduler_declaring_chunked_prefill_must_chunk():
    liar = replace(continuous.COMPONENT, factory=_never_chunks)
    with pytest.raises(AssertionError, match="split into chunks"):
        kit(SchedulerConformance, liar).test_long_prompt_is_chunked_alongside_decodes()
    honest = replace(liar, capabilities={"preemption": "recompute"})
    with pytest.raises(pytest.skip.Exception, match="declares no chunked_prefill"):
        kit(SchedulerConformance, honest).test_long_prompt_is_chunked_alongside_decodes()


class NoCopyOnWrite(PagedAllocator):
    def fork(self, parent, child):  # copies the table without taking references
        self._tables[child.seq_id] = list(self._tables.get(parent.seq_id, []))


def test_allocator_declaring_fork_must_share_blocks_safely():
    broken = replace(PAGED, factory=lambda o, c: NoCopyOnWrite(o.num_blocks, o.block_size))
    with pytest.raises(AssertionError):
        kit(AllocatorConformance, broken).test_fork_shares_then_copies_on_write()
    undeclared = replace(broken, capabilities={"truncate": True})
    with pytest.raises(pytest.skip.Exception, match="declares no fork"):
        kit(AllocatorConformance, undeclared).test_fork_shares_then_copies_on_write()
    kit(AllocatorConformance, undeclared).test_random_operations_never_leak(seed=3)  # no forks tried


# --- quantizers ----------------------------------------------------------------------------------


class DropsBias(Quantizer):
    """Builds layers whose bias never loads: wrong wherever a layer has one."""

    def linear_factory(self):
        def make(spec):
            layer = default_linear(spec)
            if layer.bias is not None:
                layer.bias.weight_loader = lambda param, loaded, shard_id=None: param.data.zero_()
            return layer

        return make


class ReusesOutput(Quantizer):
    """Builds layers that write every call's result into one kept buffer (right values, but the
    model's in-place residual adds would overwrite the previous result)."""

    def linear_factory(self):
        def make(spec):
            layer = default_linear(spec)
            plain = layer.forward

            def forward(x):
                out = plain(x)
                kept = layer.__dict__.setdefault("kept", torch.empty_like(out))
                return kept.resize_as_(out).copy_(out)

            layer.forward = forward
            return layer

        return make


def test_quantizer_kit_catches_a_layer_that_returns_a_kept_buffer():
    reuse = replace(none_quantizer.COMPONENT, name="reuses-output", factory=lambda o, c: ReusesOutput())
    with pytest.raises(AssertionError, match="output shares memory .* a new tensor the caller owns"):
        kit(QuantizerConformance, reuse).test_linear_layers_match_dense_reference()


def test_quantizer_kit_checks_the_declared_kv_cache_dtype():
    liar = replace(none_quantizer.COMPONENT, capabilities={"kv_cache_dtype": "float16"})
    with pytest.raises(AssertionError, match="declares kv_cache_dtype 'float16', its instance has None"):
        kit(QuantizerConformance, liar).test_kv_cache_dtype_as_declared()


def test_quantizer_kit_catches_a_layer_computing_wrongly():
    broken = replace(none_quantizer.COMPONENT, name="drops-bias", factory=lambda o, c: DropsBias())
    with pytest.raises(
        AssertionError, match=r"linear layers.0.kit_proj \(37 -> \(53,\), bias=True\): relative error"
    ):
        kit(QuantizerConformance, broken).test_linear_layers_match_dense_reference()


class Int8Linear(nn.Module):
    """Weight-only int8, per-output-channel scales, quantized as each part loads."""

    def __init__(self, spec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.out_features, spec.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(spec.out_features), requires_grad=False) if spec.bias else None
        offsets = [sum(spec.output_sizes[:i]) for i in range(len(spec.output_sizes))]

        def load(param, loaded, shard_id=None):
            rows = (
                param.data if shard_id is None else param.data.narrow(0, offsets[shard_id], loaded.shape[0])
            )
            value = loaded.float()
            if param is self.weight:
                scale = value.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
                value = torch.round(value / scale) * scale
            rows.copy_(value)

        self.weight.weight_loader = load
        self.weight.num_shards = len(spec.output_sizes)
        if self.bias is not None:
            self.bias.weight_loader = load
            self.bias.num_shards = len(spec.output_sizes)
        self.dtype = spec.params_dtype

    def forward(self, x):
        b = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.weight.to(x.dtype), b)


class Int8(Quantizer):
    def linear_factory(self):
        return Int8Linear


INT8 = Component(
    name="kit-int8", kind="quantizer", factory=lambda o, c: Int8(), capabilities={"dtypes": ("float32",)}
)


def test_a_lossy_quantizer_passes_within_its_declared_error_and_fails_without(tiny_model_path):
    lossy = kit(QuantizerConformance, INT8, quantization_error=0.02)
    lossy.test_linear_layers_match_dense_reference()
    lossy.test_model_scores_like_unquantized(tiny_model_path)
    with pytest.raises(AssertionError, match="relative error"):
        kit(QuantizerConformance, INT8).test_linear_layers_match_dense_reference()


# --- speculators ---------------------------------------------------------------------------------


class Greedy(Speculator):
    """Proposes `k` copies of the sequence's last token; wrong in the ways set below."""

    adaptive = False  # asked every step: what the kit catches must not hang on the policy's timing

    def __init__(self, k: int, declared: int, mutate: bool = False) -> None:
        self.k, self.num_draft_tokens, self.mutate = k, declared, mutate
        self.mutated: set[int] = set()

    def propose(self, seqs):
        out = {}
        for seq in seqs:
            out[seq.seq_id] = [seq.token_ids[-1]] * self.k
            # A drafter editing the sequence it reads, once per sequence (the first step it is
            # asked on after two output tokens).
            if self.mutate and seq.num_output_tokens >= 2 and seq.seq_id not in self.mutated:
                self.mutated.add(seq.seq_id)
                seq.token_ids[-1] = (seq.token_ids[-1] + 1) % 200
        return out


def _speculator(name, **kw):
    return Component(name=name, kind="speculator", factory=lambda o, c: Greedy(**kw))


def test_speculator_kit_catches_more_drafts_than_declared(tiny_model_path):
    with pytest.raises(AssertionError, match="3 drafts proposed, more than num_draft_tokens=2"):
        kit(
            SpeculatorConformance, _speculator("too-many", k=3, declared=2)
        ).test_greedy_tokens_identical_to_plain_decoding(tiny_model_path)


def test_speculator_kit_catches_drafts_that_change_greedy_output(tiny_model_path):
    with pytest.raises(AssertionError, match="differ from plain decoding"):
        kit(
            SpeculatorConformance, _speculator("meddler", k=2, declared=2, mutate=True)
        ).test_greedy_tokens_identical_to_plain_decoding(tiny_model_path)
    kit(
        SpeculatorConformance, _speculator("fine", k=2, declared=2)
    ).test_greedy_tokens_identical_to_plain_decoding(tiny_model_path)


def test_the_statistical_check_detects_a_sampler_that_ignores_the_target():
    from lmstack.testing.speculator import DRAFT, TARGET, TV_BOUND, total_variation, verified_first_tokens

    p, q = torch.tensor(TARGET), torch.tensor(DRAFT)
    # Verifying against q instead of p (a sampler that trusts the drafts) lands far from p.
    assert total_variation(verified_first_tokens(q, q, samples=500), p) > 5 * TV_BOUND


# --- parallel layouts ----------------------------------------------------------------------------


def test_parallel_kit_catches_a_wrong_world_size():
    liar = replace(single.COMPONENT, capabilities={"world_size": 2})
    with pytest.raises(AssertionError, match="declares world_size 2, its instance has 1"):
        kit(ParallelConformance, liar).test_world_size_as_declared()


# --- naming the component --------------------------------------------------------------------------


def test_a_kit_without_a_component_says_what_to_set():
    with pytest.raises(AssertionError, match="set `component` on the scheduler kit subclass"):
        kit(SchedulerConformance, None).test_registered_component_builds()


def test_an_unknown_name_lists_the_installed():
    with pytest.raises(
        Exception, match="unknown scheduler 'nope'; installed scheduler components: .*continuous"
    ):
        kit(SchedulerConformance, "nope").test_registered_component_builds()


def test_a_component_of_another_kind_is_refused():
    with pytest.raises(AssertionError, match="allocator 'paged' was given to the scheduler kit"):
        kit(SchedulerConformance, PAGED).test_registered_component_builds()


class CoarseLinear(Int8Linear):
    """Weights rounded to 2 bits per value: far more error than int8."""

    def __init__(self, spec):
        super().__init__(spec)
        inner = self.weight.weight_loader

        def load(param, loaded, shard_id=None):
            scale = loaded.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 1.5
            inner(param, torch.round(loaded.float() / scale).clamp(-2, 1) * scale, shard_id)

        self.weight.weight_loader = load


class Coarse(Quantizer):
    def linear_factory(self):
        return CoarseLinear


def test_model_level_check_catches_a_format_worse_than_declared(tiny_model_path):
    coarse = replace(INT8, name="kit-coarse", factory=lambda o, c: Coarse())
    with pytest.raises(AssertionError, match="probability .* with the quantizer"):
        kit(QuantizerConformance, coarse, quantization_error=0.02).test_model_scores_like_unquantized(
            tiny_model_path
        )


# --- a plugin's own test module ---------------------------------------------------------------------


def test_a_plugin_test_module_needs_only_the_subclass(pytester):
    """No conftest: the kits' fixtures (tiny_model_path) come from lmstack's pytest11 entry point."""
    pytester.makepyfile(
        test_mine="""
        from lmstack.testing import ParallelConformance

        class TestSingle(ParallelConformance):
            component = "single"
        """
    )
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    # One engine test skips: `single` starts no worker to kill.
    result.assert_outcomes(passed=4, skipped=1)


def test_the_build_context_holds_what_the_engine_built_before():
    seen = {}

    def factory(options, ctx):
        seen.update(components=dict(ctx.components), limits=ctx.limits, allocator=ctx.allocator)
        return Greedy(k=1, declared=1)

    build_component(Component(name="peek", kind="speculator", factory=factory), "speculator")
    built = seen["components"]
    assert list(built) == [
        "quantizer",
        "attention_prefill",
        "attention_decode",
        "parallel",
        "cache",
        "allocator",
        "scheduler",
    ]
    assert built["attention_prefill"] is built["attention_decode"]
    assert built["allocator"] is seen["allocator"] is built["scheduler"].allocator
    assert seen["limits"] is not None
