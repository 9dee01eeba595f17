"""Building a resolved stack's components, in the role table's order.

Each role's factory gets its options and the `BuildContext`, which fills up as roles are built
(`ctx.components` holds every instance built so far, by role). The engine-level steps that
sit between roles — the executor and the weights after the parallel layout, the KV cache after
the allocator, the limits before the scheduler — are the only role-specific code; a new kind
in `lmstack.roles` is built here with no edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmstack.executor import ExecutorSpec
from lmstack.interfaces import BuildContext, EngineLimits, Executor
from lmstack.model.architecture import ModelRegistry
from lmstack.model.config import ModelConfig
from lmstack.resolve import ResolvedStack, Selected
from lmstack.roles import ROLES


@dataclass
class BuiltStack:
    components: dict[str, Any]  # role -> instance, in build order
    executor: Executor
    limits: EngineLimits
    ctx: BuildContext


class _Builder:
    def __init__(self, stack: ResolvedStack, model_config: ModelConfig, models: ModelRegistry) -> None:
        self.stack, self.mc, self.models = stack, model_config, models
        self.ctx = BuildContext(model_config, stack.device, stack.dtype, stack.kv_cache_dtype)
        mc = model_config
        self.max_positions = min(
            mc.max_position_embeddings, stack.config.max_model_len or mc.max_position_embeddings
        )
        self.executor: Executor | None = None
        self.limits: EngineLimits | None = None

    def run(self) -> BuiltStack:
        built = self.ctx.components
        for role in ROLES:
            sel = self.stack.selected[role.name]
            getattr(self, f"_before_{role.name}", lambda: None)()
            built[role.name] = self._reused(role.name, sel, built) or sel.component.factory(
                sel.options, self.ctx
            )
            getattr(self, f"_after_{role.name}", lambda: None)()
        assert self.executor is not None and self.limits is not None  # set by the stages below
        return BuiltStack(dict(built), self.executor, self.limits, self.ctx)

    def _reused(self, role: str, sel: Selected, built: dict[str, Any]) -> Any:
        # One instance fills two roles when the stack picks the same component with the same
        # options for both (a kernel used for prefill and decode).
        for other, instance in built.items():
            osel = self.stack.selected[other]
            if osel.component is sel.component and osel.options == sel.options:
                return instance
        return None

    # --- the engine's steps between roles ------------------------------------------------------

    def _after_parallel(self) -> None:
        c = self.ctx.components
        self.executor = c["parallel"].create_executor(
            ExecutorSpec(
                model=self.stack.model,
                model_config=self.mc,
                dtype=self.stack.dtype,
                device=self.stack.device,
                kv_cache_dtype=self.stack.kv_cache_dtype,
                max_positions=self.max_positions,
                quantizer=c["quantizer"],
                prefill=c["attention_prefill"],
                decode=c["attention_decode"],
                stack=self.stack,
                models=self.models,
            )
        )
        self.executor.load_model()

    def _before_allocator(self) -> None:
        assert self.executor is not None
        block_size = getattr(self.stack.allocator.options, "block_size", 16)
        self.ctx.kv_bytes_per_block = self.executor.kv_cache_bytes_per_block(block_size)

    def _after_allocator(self) -> None:
        assert self.executor is not None
        allocator = self.ctx.components["allocator"]
        self.executor.init_kv_cache(allocator.num_blocks, allocator.block_size)
        self.ctx.allocator = allocator

    def _before_scheduler(self) -> None:
        allocator = self.ctx.components["allocator"]
        opts = self.stack.scheduler.options
        self.limits = self.ctx.limits = EngineLimits(
            max_model_len=min(self.max_positions, allocator.num_blocks * allocator.block_size),
            max_num_seqs=getattr(opts, "max_num_seqs", 256),
            max_num_batched_tokens=getattr(opts, "max_num_batched_tokens", 2048),
        )


def build_stack(stack: ResolvedStack, model_config: ModelConfig, models: ModelRegistry) -> BuiltStack:
    """Build every role's component, the executor (weights loaded) and the KV cache."""
    return _Builder(stack, model_config, models).run()
