"""Building a resolved stack's components, in the role table's order.

Each role's factory gets its options and the `BuildContext`, which fills up as roles are built
(`ctx.components` holds every instance built so far, by role). The engine-level steps that
sit between roles — the executor and the weights after the parallel layout, the cache's
geometry after the cache, the KV cache after the allocator, the limits before the scheduler —
are the only role-specific code; a new kind in `lmstack.roles` is built here with no edit.

Whatever a factory (or the model load after the parallel layout) raises comes out as a
`BuildError` naming the role, the component and its distribution, in one line; the original
traceback goes to the log at debug level. `check_build` runs the factories without the
executor, the weights or the KV cache, for `lmstack check --build`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from lmstack.content_hash import CacheGeometry, config_digest
from lmstack.errors import BuildError
from lmstack.exec.executor import ExecutorSpec
from lmstack.interfaces import BuildContext, EngineLimits, Executor
from lmstack.kernels.hardware import usable_cpus
from lmstack.model.architecture import ModelRegistry
from lmstack.model.bounds import table_positions
from lmstack.model.config import ModelConfig
from lmstack.roles import ROLE, ROLES
from lmstack.stack.resolve import DTYPE_NAMES, ResolvedStack, Selected

log = logging.getLogger(__name__)


@dataclass
class BuiltStack:
    components: dict[str, Any]  # role -> instance, in build order
    executor: Executor
    limits: EngineLimits
    ctx: BuildContext


class _Builder:
    def __init__(
        self,
        stack: ResolvedStack,
        model_config: ModelConfig,
        models: ModelRegistry,
        *,
        load: bool = True,
        source: object = None,
    ) -> None:
        self.stack, self.mc, self.models, self.source = stack, model_config, models, source
        # load=False: factories only; no executor, no weights, no KV cache (`check_build`).
        self.load = load
        self.ctx = BuildContext(model_config, stack.device, stack.dtype, stack.kv_cache_dtype)
        # RoPE tables cover the context served, not whatever the checkpoint claims (bounds.py).
        self.max_positions = table_positions(model_config.max_position_embeddings, stack.config.max_model_len)
        self.executor: Executor | None = None
        self.limits: EngineLimits | None = None

    def run(self) -> dict[str, Any]:
        built = self.ctx.components
        for role in ROLES:
            sel = self.stack.selected[role.name]
            # The steps around a role's factory use what it built: their failures are its.
            with _blame(role.name, sel):
                getattr(self, f"_before_{role.name}", lambda: None)()
                built[role.name] = self._reused(role.name, sel, built) or sel.component.factory(
                    sel.options, self.ctx
                )
                getattr(self, f"_after_{role.name}", lambda: None)()
        return dict(built)

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
        if not self.load:
            return
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
                source=self.source,
            )
        )
        with _blame("parallel", self.stack.parallel, what=f"failed to load the model {self.stack.model!r}"):
            self.executor.load_model()
        self.ctx.executor = self.executor

    def _after_cache(self) -> None:
        cache = self.ctx.components["cache"]
        mc, q = self.mc, self.stack.quantizer
        cache.bind(
            CacheGeometry(
                model=self.stack.model,
                model_config=config_digest(mc),
                dtype=DTYPE_NAMES[self.stack.dtype],
                quantizer=json.dumps([q.name, q.describe()["options"]], sort_keys=True, default=str),
                num_layers=mc.num_layers,
                num_kv_heads=mc.num_kv_heads,
                head_dim=mc.head_dim,
                kv_cache_dtype=DTYPE_NAMES[self.stack.kv_cache_dtype],
                block_size=getattr(self.stack.allocator.options, "block_size", 16),
                device=str(self.stack.device),
            )
        )
        self.ctx.block_cache = cache if cache.reuses_blocks else None

    def _before_allocator(self) -> None:
        block_size = getattr(self.stack.allocator.options, "block_size", 16)
        if self.executor is not None:
            self.ctx.kv_bytes_per_block = self.executor.kv_cache_bytes_per_block(block_size)
        else:  # no executor (check_build): the single-device layout's geometry, from the config
            self.ctx.kv_bytes_per_block = block_size * self.mc.kv_bytes_per_token(
                self.stack.kv_cache_dtype.itemsize
            )

    def _after_allocator(self) -> None:
        allocator = self.ctx.components["allocator"]
        if self.executor is not None:
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


def build_stack(
    stack: ResolvedStack, model_config: ModelConfig, models: ModelRegistry, *, source: object = None
) -> BuiltStack:
    """Build every role's component, the executor (weights loaded) and the KV cache. `source`:
    the model source already open in this process (`lmstack.model.source.ModelSource`), else the
    executor opens the model. Raises `BuildError` when a factory or the model load fails."""
    if stack.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The cores this process may use (a cpuset or taskset), not the machine's count.
        torch.set_num_threads(usable_cpus())
    builder = _Builder(stack, model_config, models, source=source)
    components = builder.run()
    assert builder.executor is not None and builder.limits is not None  # set by the stages above
    return BuiltStack(components, builder.executor, builder.limits, builder.ctx)


def check_build(stack: ResolvedStack, model_config: ModelConfig, models: ModelRegistry) -> dict[str, Any]:
    """Run every role's factory as `build_stack` would, without creating the executor, loading
    weights or allocating the KV cache: the allocator gets the KV block size computed from the
    model config (as the single-device layout lays it out), the scheduler and speculator the
    limits that follow. Returns role -> instance; raises `BuildError` like `build_stack`."""
    return _Builder(stack, model_config, models, load=False).run()


class _blame:
    """Turn any exception inside into a `BuildError` naming the role's component."""

    def __init__(self, role: str, sel: Selected, what: str = "failed to build") -> None:
        self.role, self.sel, self.what = role, sel, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, BuildError) or not isinstance(exc, Exception):
            return False  # KeyboardInterrupt and friends pass; a BuildError already says who
        c = self.sel.component
        error = BuildError(ROLE[self.role].label, c.name, c.distribution, c.version, exc, what=self.what)
        log.debug("%s", error, exc_info=exc)
        raise error from exc
