"""Example third-party lmstack plugin: scheduler `priority`.

It reuses the core's continuous-batching scheduler (budgets, chunked prefill, preemption) and
changes only the order in which waiting sequences are admitted (and running ones preempted):

- ``policy: priority`` — lower `request.priority` first, then arrival order;
- ``policy: shortest-first`` — least predicted work first: prompt length plus the request's
  `max_tokens` (the output length it may reach), then arrival order.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmstack.components.continuous import ContinuousOptions, ContinuousScheduler
from lmstack.engine.step_cost import StepCostModel
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BuildContext, EngineLimits, KVAllocator
from lmstack.registry import Component
from lmstack.sequence import Sequence

__all__ = ["PriorityOptions", "PriorityScheduler", "COMPONENT", "lmstack_register_schedulers"]


class PriorityOptions(ContinuousOptions, forbid_unknown_fields=True):
    """Everything `continuous` accepts, plus the admission policy."""

    policy: Annotated[
        Literal["priority", "shortest-first"],
        msgspec.Meta(description="admit by Request.priority, or shortest predicted work first"),
    ] = "priority"


class PriorityScheduler(ContinuousScheduler):
    def __init__(
        self,
        options: PriorityOptions,
        allocator: KVAllocator,
        limits: EngineLimits,
        step_cost: StepCostModel | None = None,
    ) -> None:
        super().__init__(options, allocator, limits, step_cost)
        self.policy = options.policy
        self.max_model_len = limits.max_model_len

    def waiting_order_key(self, seq: Sequence) -> tuple:
        if self.policy == "shortest-first":
            return (self.predicted_work(seq), seq.arrival_time, seq.seq_id)
        return (seq.request.priority, seq.arrival_time, seq.seq_id)

    def predicted_work(self, seq: Sequence) -> int:
        """Tokens the sequence may need in all: its prompt plus its predicted output length.
        Without `max_tokens` a request may run to the context length."""
        max_tokens = seq.request.params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(seq.prompt_len + max_tokens, self.max_model_len)


def build(options: PriorityOptions, ctx: BuildContext) -> PriorityScheduler:
    if ctx.allocator is None or ctx.limits is None:
        raise RuntimeError("the scheduler is built after the allocator and the engine limits")
    return PriorityScheduler(options, ctx.allocator, ctx.limits, ctx.step_cost)


COMPONENT = Component(
    name="priority",
    kind="scheduler",
    factory=build,
    options_type=PriorityOptions,
    # Inherited from `continuous`; declared so the conformance kit tests them.
    capabilities={"chunked_prefill": True, "preemption": "recompute"},
    description="Continuous batching that admits by request priority or shortest predicted job first.",
    api=">=1.4,<2",  # the lmstack plugin APIs it is written against (lmstack.plugin_api)
)


@hookimpl
def lmstack_register_schedulers(register) -> None:
    register(COMPONENT)
