"""Where this process sits in a parallel layout, and the collectives the model calls.

A parallel layout (`tp`, `pp`, `ep` plugins) starts `world_size = pp * ep * tp` ranks. Ranks are
laid out with tensor parallelism innermost:

    rank = (pp_rank * ep + ep_rank) * tp + tp_rank

- the **tp group** (same pp and ep rank) splits attention heads, MLP columns/rows and the
  vocabulary; row-parallel outputs are summed over it (`tp_all_reduce`);
- the **ep group** (same pp and tp rank) holds different experts of a mixture-of-experts layer;
  dense layers are replicated across it and every ep rank sees every token, so an expert layer
  sums its partial outputs over the **moe group** (same pp rank: ep × tp ranks);
- the **pp group** (same ep and tp rank) is one pipeline: stage `pp_rank` holds a contiguous
  range of decoder layers (`layer_range`).

A process that never called `init_parallel` is a single rank: every collective is a no-op, so
the reference model runs unchanged in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelRanks:
    """Degrees and this process's global rank: plain ints, picklable, sent to every worker."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return (self.rank // self.tp) % self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.ep)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def with_rank(self, rank: int) -> ParallelRanks:
        return ParallelRanks(self.tp, self.pp, self.ep, rank)

    def rank_of(self, *, pp_rank: int, ep_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.ep + ep_rank) * self.tp + tp_rank


def layer_range(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` holds: as even as possible, earlier
    stages taking the remainder (stage 0 also embeds, the last stage also runs the head)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} needs 1..{num_layers} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def divide(total: int, parts: int, what: str) -> int:
    """`total / parts`, or ValueError naming `what` when it does not divide."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by {parts}")
    return total // parts


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of shard `index` when `total` splits evenly into `parts`."""
    size = divide(total, parts, "size")
    return index * size, (index + 1) * size


@dataclass
class ParallelState:
    """This process's ranks and the process groups built for them (None when a group has one
    member: its collectives are no-ops)."""

    ranks: ParallelRanks = field(default_factory=ParallelRanks)
    tp_group: Any = None
    ep_group: Any = None
    moe_group: Any = None  # ep x tp ranks of this pipeline stage
    pp_group: Any = None


_STATE = ParallelState()


def get_parallel() -> ParallelState:
    return _STATE


def init_parallel(ranks: ParallelRanks) -> ParallelState:
    """Create the tp / ep / moe / pp groups (every rank must call this, in the same order, after
    `torch.distributed.init_process_group`) and make them this process's state."""
    global _STATE
    if ranks.world_size == 1:
        _STATE = ParallelState(ranks)
        return _STATE
    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed initialised first")
    if dist.get_world_size() != ranks.world_size:
        raise RuntimeError(
            f"process group has {dist.get_world_size()} ranks, layout needs {ranks.world_size}"
        )
    state = ParallelState(ranks)
    # new_group is collective over the whole world: every rank creates every group, keeps its own.
    for p in range(ranks.pp):
        for e in range(ranks.ep):
            members = [ranks.rank_of(pp_rank=p, ep_rank=e, tp_rank=t) for t in range(ranks.tp)]
            group = dist.new_group(members) if ranks.tp > 1 else None
            if ranks.rank in members:
                state.tp_group = group
        for t in range(ranks.tp):
            members = [ranks.rank_of(pp_rank=p, ep_rank=e, tp_rank=t) for e in range(ranks.ep)]
            group = dist.new_group(members) if ranks.ep > 1 else None
            if ranks.rank in members:
                state.ep_group = group
        members = [
            ranks.rank_of(pp_rank=p, ep_rank=e, tp_rank=t) for e in range(ranks.ep) for t in range(ranks.tp)
        ]
        group = dist.new_group(members) if len(members) > 1 else None
        if ranks.rank in members:
            state.moe_group = group
    for e in range(ranks.ep):
        for t in range(ranks.tp):
            members = [ranks.rank_of(pp_rank=p, ep_rank=e, tp_rank=t) for p in range(ranks.pp)]
            group = dist.new_group(members) if ranks.pp > 1 else None
            if ranks.rank in members:
                state.pp_group = group
    _STATE = state
    return state


def reset_parallel() -> None:
    """Back to a single rank (tests; a worker shutting down)."""
    global _STATE
    _STATE = ParallelState()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place); a no-op on one rank."""
    group = _STATE.tp_group
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def moe_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over this stage's ep x tp ranks (expert outputs); a no-op on one rank."""
    group = _STATE.moe_group
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tp rank's `x` along `dim`, in rank order; `x` itself on one rank."""
    group = _STATE.tp_group
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.ranks.tp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
