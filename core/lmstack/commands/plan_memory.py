"""`lmstack plan`'s memory figures: a stack's memory as it will run — weights resident, KV per
token / block / sequence, an activation estimate, the runtime — against the device's memory,
and the sequences of a given context the KV cache holds.

The KV figures are the allocator's own arithmetic (`components.paged.build`): the block size
and budget from the stack's `allocator` options, `kv_cache_memory: auto` through the same rule
(`kernels.hardware.kv_budget_from`) with the weights' bytes taken off what is free now, since
the engine measures after loading them and this process does not load them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lmstack.errors import LmstackError

# Bytes of one logit row's element: the sampler works on float32 logits.
_LOGIT_BYTES = 4


@dataclass
class MemoryPlan:
    device: str
    context: int
    max_model_len: int
    # Weights as they will be resident, and how that figure was obtained.
    weights_bytes: int
    weights_how: str
    kv_dtype: str
    kv_bytes_per_token: int
    block_size: int
    kv_bytes_per_block: int
    blocks_per_sequence: int
    kv_bytes_per_sequence: int
    num_blocks: int
    kv_cache_bytes: int
    kv_budget_how: str
    activation_bytes: int
    activation_how: str
    runtime_bytes: int
    runtime_how: str
    device_total_bytes: int | None
    device_available_bytes: int | None
    sequences_fit: int
    max_num_seqs: int

    @property
    def concurrent(self) -> int:
        """Sequences of `context` tokens that can run at once: the KV cache's and the
        scheduler's limit, whichever is lower."""
        return min(self.sequences_fit, self.max_num_seqs)

    @property
    def planned_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.runtime_bytes

    @property
    def headroom_bytes(self) -> int | None:
        """What is left once everything planned is resident: on a CPU of the memory available now
        (this process's runtime is already out of it), on a GPU of the device's memory."""
        if self.device.startswith("cuda"):
            return None if self.device_total_bytes is None else self.device_total_bytes - self.planned_bytes
        if self.device_available_bytes is None:
            return None
        return self.device_available_bytes + self.runtime_bytes - self.planned_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "concurrent": self.concurrent,
            "planned_bytes": self.planned_bytes,
            "headroom_bytes": self.headroom_bytes,
        }


def weights_on_meta(prepared: Any, quantizer: Any, max_positions: int) -> int:
    """Bytes of the model's tensors built on the meta device with the stack's quantizer's
    linears (no weights read): parameters and buffers, each tensor once (a tied head counts once)."""
    r, mc = prepared.resolved, prepared.model_config
    with torch.device("meta"):
        model = prepared.source.architecture.build(
            mc, quantizer.linear_factory(), dtype=r.dtype, max_positions=max_positions
        )
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def activation_estimate(mc: Any, dtype: torch.dtype, tokens: int, rows: int) -> tuple[int, str]:
    """Peak scratch of one forward step of `tokens` tokens (the scheduler's token budget) with
    `rows` logit rows: one layer's live activations — residual and normed input, q/k/v, the
    attention output, gate/up and the activated product — in the model's dtype, plus float32
    logits. Attention kernels are taken to stream over K/V (no full score matrix)."""
    per_token = 3 * mc.hidden_size + mc.q_size + 2 * mc.kv_size + mc.q_size + 3 * mc.intermediate_size
    layer = tokens * per_token * dtype.itemsize
    logits = rows * mc.vocab_size * _LOGIT_BYTES
    how = (
        f"estimate: one layer's live tensors for a {tokens}-token step plus {rows} float32 logit rows "
        f"of {mc.vocab_size}"
    )
    return layer + logits, how


def process_rss() -> int | None:
    """This process's resident memory (torch and the plugins imported, no model yet)."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(total, available now) of the memory the KV cache will come from."""
    from lmstack.kernels.hardware import host_available_memory

    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmstackError(
                "the stack runs on cuda and no CUDA device is visible here: run `lmstack plan` on the "
                "machine that will serve it"
            )
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    return host_total_memory(), host_available_memory()


def kv_blocks(
    allocator_sel: Any,
    built_allocator: Any,
    device: torch.device,
    per_block: int,
    weights: int,
    available: int | None,
) -> tuple[int, str]:
    """The block count the allocator will have once the weights are loaded, and how it follows
    from the stack. A fixed size is what the allocator built here already holds; only
    `kv_cache_memory: auto` depends on the weights (measured again once they are loaded), so
    it is derived with the weights taken off what is free now."""
    from lmstack.components.paged import KV_MEMORY_AUTO
    from lmstack.kernels.hardware import kv_budget_from

    opts = allocator_sel.options
    fixed = getattr(opts, "num_blocks", None)
    memory = getattr(opts, "kv_cache_memory", None)
    if fixed is None and memory == KV_MEMORY_AUTO:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = kv_budget_from("cuda", max(0, free - weights), total)
        else:
            after = None if available is None else max(0, available - weights)
            budget = kv_budget_from(device.type, after, None)
        return (
            budget.bytes // per_block,
            f"kv_cache_memory {budget.reason} (the weights taken off what is free)",
        )
    n = getattr(built_allocator, "num_blocks", None)
    if not isinstance(n, int):
        raise LmstackError(
            f"allocator {allocator_sel.component.name!r} reports no num_blocks: plan cannot size its KV cache"
        )
    if fixed is not None:
        return n, f"allocator.num_blocks = {fixed}"
    if memory is not None:
        return n, f"kv_cache_memory = {memory}"
    return n, f"allocator {allocator_sel.component.name!r} as built for this stack"


def plan_memory(
    prepared: Any, built: dict[str, Any], context: int | None, measured_weights: Any = None
) -> MemoryPlan:
    """The memory plan of a prepared stack whose factories `built` ran (`check_build`).
    `measured_weights`: a `lmstack.model.memory.WeightMemory` (the model loaded); else the
    weights are counted on the meta device."""
    from lmstack.model.bounds import table_positions
    from lmstack.stack.resolved import DTYPE_NAMES

    r, mc = prepared.resolved, prepared.model_config
    max_positions = table_positions(mc.max_position_embeddings, r.config.max_model_len)
    if measured_weights is not None:
        weights = measured_weights.resident_bytes
        weights_how = f"loaded here with quantizer {r.quantizer.name} and measured"
    else:
        weights = weights_on_meta(prepared, built["quantizer"], max_positions)
        weights_how = "counted on the meta device (no weights loaded)"

    total, available = device_memory(r.device)
    block_size = getattr(r.allocator.options, "block_size", getattr(built["allocator"], "block_size", 16))
    per_token = mc.kv_bytes_per_token(r.kv_cache_dtype.itemsize)
    per_block = block_size * per_token
    num_blocks, kv_how = kv_blocks(r.allocator, built["allocator"], r.device, per_block, weights, available)
    if num_blocks < 1:
        raise LmstackError(f"the KV cache holds no block of {per_block} bytes ({kv_how})")
    max_model_len = min(max_positions, num_blocks * block_size)
    context = max_model_len if context is None else context
    if context > max_model_len:
        raise LmstackError(
            f"--context {context} is beyond what this stack serves: max_model_len {max_model_len} "
            f"(the model's {mc.max_position_embeddings} positions, max_model_len "
            f"{r.config.max_model_len}, a KV cache of {num_blocks * block_size} tokens)"
        )
    blocks_per_seq = -(-context // block_size)

    sched = r.scheduler.options
    max_num_seqs = getattr(sched, "max_num_seqs", 256)
    step_tokens = getattr(sched, "max_num_batched_tokens", 2048)
    activations, act_how = activation_estimate(mc, r.dtype, step_tokens, max_num_seqs)
    if r.device.type == "cuda":
        runtime = max(0, (total or 0) - (available or 0))
        runtime_how = "in use on the device now (CUDA context, other processes)"
    else:
        runtime = process_rss() or 0
        runtime_how = (
            "this process's resident memory: torch, the plugins, the components built (the allocator's "
            "block tables); a server adds its own"
        )

    return MemoryPlan(
        device=str(r.device),
        context=context,
        max_model_len=max_model_len,
        weights_bytes=weights,
        weights_how=weights_how,
        kv_dtype=DTYPE_NAMES.get(r.kv_cache_dtype, str(r.kv_cache_dtype)),
        kv_bytes_per_token=per_token,
        block_size=block_size,
        kv_bytes_per_block=per_block,
        blocks_per_sequence=blocks_per_seq,
        kv_bytes_per_sequence=blocks_per_seq * per_block,
        num_blocks=num_blocks,
        kv_cache_bytes=num_blocks * per_block,
        kv_budget_how=kv_how,
        activation_bytes=activations,
        activation_how=act_how,
        runtime_bytes=runtime,
        runtime_how=runtime_how,
        device_total_bytes=total,
        device_available_bytes=available,
        sequences_fit=num_blocks // blocks_per_seq,
        max_num_seqs=max_num_seqs,
    )
