"""The checks that the model's experts split over the degrees a stack asks for (the layout
itself is the core's `lmstack.exec.parallel_layout.ShardedLayout`: one worker process per rank).

Placement and dispatch (the model side is `lmstack.model.moe`): dense layers are replicated
across the ep ranks, so every ep rank has every token; ep rank r holds experts [r * E / ep,
(r + 1) * E / ep), runs them on the tokens routed to them (the router is replicated, so every
rank routes alike), and one all-reduce over the moe group (ep x tp ranks) sums the partial
outputs. No token moves between ranks: the all-reduce is the dispatch and the combine. An
all-to-all dispatch only pays when the tokens are sharded across ep ranks (data-parallel
attention), which this layout does not do; the README has the byte counts.
"""

from __future__ import annotations

from lmstack.errors import ResolutionError
from lmstack.exec.parallel_layout import check_tensor_parallel
from lmstack.interfaces import BuildContext
from lmstack.model.moe import MoEConfig, valid_ep_degrees


def _listed(degrees: list[int]) -> str:
    return ", ".join(map(str, degrees[:-1])) + f" or {degrees[-1]}" if len(degrees) > 1 else str(degrees[0])


def check_expert_parallel(ep: int, tp: int, ctx: BuildContext) -> None:
    """ResolutionError when the model (`ctx.model_config`) is not a mixture-of-experts model,
    its experts do not split over `ep` ranks (naming the degrees that would), or `tp` does not
    split its layers. Nothing to check without a model config (a factory built alone)."""
    mc = ctx.model_config
    if mc is None:
        return
    model = f"model {mc.name!r}" if mc.name else "the model"
    if not isinstance(mc, MoEConfig):
        if ep > 1:
            raise ResolutionError(
                f"parallel.ep: {model} is not a mixture-of-experts model, so ep={ep} has no experts to "
                "split; use the `tp` or `pp` layout for a dense model"
            )
        return
    if mc.num_experts % ep:
        raise ResolutionError(
            f"parallel.ep: ep={ep} does not divide the {mc.num_experts} experts of {model}; "
            f"ep can be {_listed(valid_ep_degrees(mc.num_experts))}"
        )
    if tp > 1:
        _check_tp(tp, mc, model, ctx)


def _check_tp(tp: int, mc: MoEConfig, model: str, ctx: BuildContext) -> None:
    check_tensor_parallel(tp, mc, ctx.components.get("quantizer"))  # heads, widths, quantizer alignment
    widths = {
        "expert width": mc.moe_intermediate_size,
        "shared expert width": mc.shared_expert_intermediate_size,
    }
    for what, width in widths.items():
        if width % tp:
            ok = [d for d in range(1, width + 1) if width % d == 0 and mc.hidden_size % d == 0]
            raise ResolutionError(
                f"parallel.tp: tp={tp} does not divide the {what} {width} of {model}; tp can be {_listed(ok)}"
            )


def check_cache_tiers(tp: int, stack) -> str | None:
    """With tp > 1 each rank caches only its KV heads, and a lower cache tier swaps blocks
    through worker rank 0: the other ranks' heads would be lost (as under the `tp` layout)."""
    tiers = tuple(stack.cache.capabilities.get("tiers") or ("device",))
    if tp > 1 and tiers != ("device",):
        return (
            f"keeps each tp rank's KV heads on its own device, but cache {stack.cache.name!r} moves "
            f"blocks to {', '.join(t for t in tiers if t != 'device')}; use a device-only cache "
            "(cache: prefix or none) with tp > 1"
        )
    return None
