"""The plugin API: what a plugin may import from lmstack, and the version of that surface.

`PLUGIN_API_VERSION` is ``"major.minor"``. The minor number goes up when something is added
to the surface below (a new interface method with a default, a new capability, a new module);
the major number goes up when something a plugin may rely on changes or goes away (a renamed
argument, a removed name, a new abstract method). A plugin declares the versions it works
with on each component, ``Component(..., api=">=1.0,<2")`` (a PEP 440 specifier set); lmstack
refuses a component whose range excludes `PLUGIN_API_VERSION`, naming both versions.

`PUBLIC_API` maps each public module to the names in it a plugin may import:

- ``lmstack.interfaces``: the abstract base per kind, `BuildContext`, `EngineLimits`;
- ``lmstack.registry``: `Component`, `NoOptions`, `StackSection`; ``lmstack.hookspecs``:
  `hookimpl`; ``lmstack.roles``: the capability structs;
- the values passed through the interfaces: ``lmstack.batch``, ``lmstack.sequence``,
  ``lmstack.sampling_params``, ``lmstack.spec.drafts``, ``lmstack.sample.verification``,
  ``lmstack.outputs``, ``lmstack.model.config`` (`ModelConfig`), ``lmstack.exec.executor``
  (what a parallel layout creates executors from);
- ``lmstack.errors``: the errors a component raises for bad input;
- ``lmstack.testing``: the conformance kits, `build_component`, the tiny test model;
  ``lmstack.testing.fixtures``: the pytest fixture `tiny_model_path`;
- the reference components a plugin may extend or delegate to
  (``lmstack.components.continuous``, ``paged``, ``torch_attention``, ``single``,
  ``none_quantizer``, ``none_speculator``, ``none_cache``);
- ``lmstack.content_hash``: stable KV-block content hashes and the cache geometry (caches);
- what quantizers and layouts build on: ``lmstack.model.shard`` (one tensor-parallel shard
  arithmetic), ``lmstack.model.quantized_linear``, the weight loaders and checkpoint tensors,
  ``lmstack.exec.distributed`` and the parallel layouts' bases;
- ``lmstack.kernels``: the native (C++) extension build, Triton support, scratch buffers and CPU
  feature detection that kernel plugins share;
- front ends (lmstack-api, lmstack-bench, an embedder's server): ``lmstack.stack.prepare`` (one
  pass through a stack), the engines, the stack loader and resolver, grammar compilation.

In-tree distributions import nothing else (``tests/test_structure.py`` scans them). Modules that
moved in 1.8 still import from their old paths until 2.0 (``lmstack._moved``).

Everything else in lmstack is internal and may change in any release.
"""

from __future__ import annotations

PLUGIN_API_VERSION = "1.10"  # 1.10: isa_cap, hardware_flags; 1.9: stack_mapping, apply_overrides, the step bound; 1.8: modules by concern
"""The plugin API this lmstack provides; see the module docstring for when it changes."""

PUBLIC_API: dict[str, tuple[str, ...]] = {
    "lmstack.interfaces": (
        "BuildContext",
        "EngineLimits",
        "BlockCache",
        "KVAllocator",
        "ScheduledSeq",
        "SchedulerOutput",
        "Scheduler",
        "AttentionBackend",
        "LinearSpec",
        "Quantizer",
        "Speculator",
        "DraftFeedback",
        "Executor",
        "ParallelLayout",
        "LinearFactory",  # 1.8
    ),
    "lmstack.registry": ("Component", "NoOptions", "StackSection"),
    "lmstack.hookspecs": ("hookimpl", "hookspec"),  # 1.8: hookspec, for hooks a plugin owns
    "lmstack.roles": (
        "Capabilities",
        "SchedulerCapabilities",
        "AllocatorCapabilities",
        "AttentionCapabilities",
        "QuantizerCapabilities",
        "SpeculatorCapabilities",
        "ParallelCapabilities",
    ),
    "lmstack.batch": ("AttentionMetadata", "SeqPlan", "StepPlan", "ModelInput", "ModelOutput"),
    "lmstack.sequence": ("Sequence", "SequenceStatus", "FinishReason", "Request"),
    "lmstack.sampling_params": ("SamplingParams", "BATCH_PRIORITY"),  # 1.9: BATCH_PRIORITY,
    "lmstack.spec.drafts": ("DraftBook",),
    "lmstack.sample.verification": ("Draft", "Verification"),
    "lmstack.outputs": ("CompletionOutput", "RequestMetrics", "RequestOutput", "EngineStats"),
    "lmstack.model.config": ("ModelConfig",),
    "lmstack.exec.executor": ("ExecutorSpec", "InProcessExecutor"),
    "lmstack.errors": (
        "LmstackError",
        "ConfigError",
        "ResolutionError",
        "InvalidRequestError",
        "BuildError",
        "one_line",
        "EngineDeadError",  # 1.8
    ),
    "lmstack.testing": (
        "AllocatorConformance",
        "AttentionConformance",
        "CacheConformance",
        "ParallelConformance",
        "QuantizerConformance",
        "SchedulerConformance",
        "SpeculatorConformance",
        "ToolParserConformance",  # 1.8
        "ComponentKit",
        "build_component",
        "make_seq",
        "plain_attention",
        "reference_attention",
        "simulate",
        "write_tiny_model",
    ),
    "lmstack.testing.components": ("build_component", "make_context"),
    "lmstack.testing.tiny_model": ("write_tiny_model",),
    "lmstack.testing.fixtures": ("tiny_model_path",),
    "lmstack.components.continuous": ("ContinuousOptions", "ContinuousScheduler", "COMPONENT"),
    "lmstack.components.paged": ("PagedOptions", "PagedAllocator", "COMPONENT", "parse_bytes"),
    "lmstack.components.torch_attention": ("TorchAttention", "COMPONENT"),
    "lmstack.components.single": ("SingleOptions", "SingleLayout", "COMPONENT"),
    "lmstack.components.none_quantizer": ("NoQuantizer", "COMPONENT"),
    "lmstack.components.none_speculator": ("NoSpeculator", "COMPONENT"),
    "lmstack.components.none_cache": ("NoCache", "COMPONENT"),
    # 1.1: what quantizers and parallel layouts build on (issues 11 and 14).
    "lmstack.model.checkpoint": ("CheckpointTensor", "GGUFTensor", "to_dense"),
    "lmstack.model.weight_loader": (
        "default_weight_loader",
        "fused_weight_loader",
        "set_weight_loader",
        "load_named_weights",
        "take_rows",
        "take_columns",
        "column_parallel_loader",
        "row_parallel_loader",
        "shard_loader",  # 1.8
    ),
    "lmstack.model.linear": ("default_linear", "dense_parameter"),
    # 1.8: one shard arithmetic (`Shard`, built from a `LinearSpec`: `spec.shard`) and the base of
    # quantized linears (parts, bias, tensor-parallel loading).
    "lmstack.model.shard": ("Shard", "Part"),
    "lmstack.model.quantized_linear": ("QuantizedLinear",),
    "lmstack.model.tp_shard": ("part_rows", "input_columns", "keeps_bias", "bias_rows"),
    "lmstack.quant.formats": (
        "DENSE",
        "GGUF",
        "CT_PACK_QUANTIZED",
        "CT_FLOAT_QUANTIZED",
        "CT_NVFP4",
        "AUTOAWQ_GEMM",
        "checkpoint_format_id",
        "WeightFormat",
        "Calibrated",
    ),
    "lmstack.exec.distributed": (
        "ParallelRanks",
        "ParallelState",
        "get_parallel",
        "init_parallel",
        "layer_range",
        "tp_all_reduce",
        "tp_all_gather",
        "moe_all_reduce",
    ),
    "lmstack.exec.parallel_layout": ("ShardedLayout", "check_tensor_parallel"),
    "lmstack.exec.multiproc": ("MultiprocExecutor", "launched", "run_launched_worker"),  # 1.8: the last two
    "lmstack.content_hash": ("CacheGeometry", "block_hash", "config_digest", "hash_hex", "request_key"),
    # 1.3: speculation (issue 12): feedback to the drafter, the adaptive draft length.
    "lmstack.spec.draft_policy": ("DraftLengthPolicy",),
    # 1.4: the engine's measured step cost (issue 15), `BuildContext.step_cost`.
    "lmstack.engine.step_cost": ("StepCostModel",),
    # 1.8: the core grouped by concern (issue 56). Old module paths still import (with a
    # DeprecationWarning) until 2.0: `lmstack._moved.MOVED`.
    # What kernel plugins build on: native builds, Triton support, scratch buffers, CPU features.
    "lmstack.kernels.native": ("NativeExtension", "ExtensionBuildError", "BuildReport"),
    "lmstack.kernels.triton_support": (
        "capabilities_with_interpreter",
        "cuda_device_conflict",
        "enable_interpreter",
        "interpreter_opt_in",
        "next_pow2",
        "split_k",
        "split_k_output",
        "reduce_splits",
    ),
    "lmstack.kernels.scratch": ("reused_buffer", "held_bytes"),
    "lmstack.kernels.hardware": (
        "cpu_flags",
        "cpu_name",
        "native_bf16_cpu",
        "usable_cpus",
        "cpu_description",
        "isa_cap",  # 1.10: LMSTACK_MAX_ISA, and the flags the CPU has beneath it (a capped run's record)
        "hardware_flags",
    ),
    # The model's building blocks a draft model (EAGLE) or an expert layout reuses.
    "lmstack.model.layer_ops": ("rms_norm", "rotate_", "silu_mul"),
    "lmstack.model.rope": ("RotaryEmbedding", "rotate"),
    "lmstack.model.moe": ("MoEConfig", "valid_ep_degrees"),
    # The model itself, for offline tools that run it on weights of their own (lmstack-calibrate:
    # `DecoderLayer.attention` / `mlp` run one block, `llama_checkpoint_name` maps the names).
    "lmstack.model.llama": ("LlamaModel", "DecoderLayer", "llama_checkpoint_name"),
    "lmstack.commands.progress": ("Progress",),
    # Front ends (lmstack-api, lmstack-bench, an embedder's own server): load, resolve and run a
    # stack the way `lmstack serve` does.
    "lmstack.engine.llm": ("LLM",),
    "lmstack.engine.async_engine": ("AsyncEngine",),
    "lmstack.engine.llm_engine": ("LLMEngine",),
    "lmstack.stack.config": ("load_stack", "stack_mapping", "KV_CACHE_DTYPES"),  # 1.9: the last two
    # 1.8: every command takes its stack the same way (MODEL_OR_STACK, --set) (issue 53).
    "lmstack.commands.stack_args": (
        "add_stack_arguments",
        "stack_from_args",
        "stack_text",
        "positive_int",
        "STACK_HELP",
    ),
    "lmstack.stack.overrides": ("parse_overrides", "apply_overrides"),  # 1.8: `--set`; 1.9: apply_overrides
    # 1.9: the bound on one engine step (the /ready probe's "stalled")
    "lmstack.exec.rendezvous": ("STEP_TIMEOUT_S", "default_step_timeout"),
    "lmstack.stack.resolve": ("ResolvedStack", "resolve", "check_model", "DTYPE_NAMES"),
    "lmstack.stack.plugins": ("make_plugin_manager", "build_registry"),
    "lmstack.stack.prepare": ("PreparedStack", "StackSource", "prepare_stack", "resolve_stack"),
    "lmstack.model.source": ("open_model_source",),
    "lmstack.sample.grammar": (
        "Grammar",
        "GrammarCompiler",
        "PreparedSchema",
        "error_reason",
        # 1.8: regex / EBNF / choice beside JSON schemas (issue 55)
        "KIND_NOUNS",
        "compile_source",
        "choice_ebnf",
    ),
    "lmstack.model.tokenizer": ("compile_chat_template",),  # 1.8: `server.chat_template`
}
"""Module -> the names in it that plugins may import (everything else is internal)."""
