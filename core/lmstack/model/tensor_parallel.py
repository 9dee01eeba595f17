"""Tensor-parallel pieces of a decoder: how attention heads split over the tp ranks, the
vocabulary-parallel embedding and LM head, and which degrees a model admits.

Heads: rank r holds query heads [r * Hq / tp, (r + 1) * Hq / tp). When tp <= Hkv the KV heads
split the same way (each rank keeps the KV heads its query heads read). When tp > Hkv each KV
head is replicated on tp / Hkv consecutive ranks: those ranks hold exactly the query heads of
that head's group. So tp must divide Hq, and either divide Hkv or be a multiple of it.

Vocabulary: rank r holds rows [r * V', (r + 1) * V') with V' = ceil(V / tp); the last shard is
zero-padded. The embedding looks up the ids in its range (zeros elsewhere) and sums over the tp
group; the head computes its V' logits and all-gathers them, so every rank ends with the full
[L, V] logits. Gathering to every rank rather than to rank 0 only costs (tp - 1) / tp of the
logits per rank in traffic but keeps the ranks symmetric: one collective, no rank-specific
code, and any rank (e.g. a pipeline's last stage) can sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmstack.exec.distributed import tp_all_gather, tp_all_reduce
from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.config import ModelConfig
from lmstack.model.weight_loader import ShardId, set_weight_loader, take_rows


@dataclass(frozen=True)
class AttentionShard:
    """One rank's share of a layer's attention heads."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_replicas: int  # ranks holding each KV head (1: the KV heads are split, not replicated)


def attention_shard(num_heads: int, num_kv_heads: int, tp: int) -> AttentionShard:
    """The per-rank head counts under `tp`; ValueError when `tp` does not fit the heads."""
    if num_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {num_heads} query heads")
    if num_kv_heads % tp == 0:
        return AttentionShard(num_heads // tp, num_kv_heads // tp, 1)
    if tp % num_kv_heads == 0:
        return AttentionShard(num_heads // tp, 1, tp // num_kv_heads)
    raise ValueError(f"tp={tp} neither divides nor is a multiple of the {num_kv_heads} KV heads")


def expand_kv_heads(tensor: CheckpointTensor, num_kv_heads: int, replicas: int) -> CheckpointTensor:
    """A k_proj / v_proj weight or bias with every KV head's rows repeated `replicas` times in
    place (head h becomes heads h * replicas .. h * replicas + replicas - 1): the layer that tp
    splits when KV heads are replicated. The column-parallel loader then gives each rank the
    copy of its group's head. Packed GGUF rows are repeated as they are."""
    if replicas == 1:
        return tensor
    rows = tuple(tensor.shape)[0]
    head_dim = rows // num_kv_heads
    index = np.repeat(np.arange(rows).reshape(num_kv_heads, 1, head_dim), replicas, axis=1).reshape(-1)
    if isinstance(tensor, GGUFTensor):
        return tensor.take_rows(index)
    return tensor.index_select(0, torch.from_numpy(index))


def vocab_shard(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """(first row, rows held, rows with a real token) of this rank's vocabulary shard."""
    local = -(-vocab_size // tp)
    start = tp_rank * local
    return start, local, max(0, min(local, vocab_size - start))


def vocab_rows_loader(vocab_size: int, tp: int, tp_rank: int):
    """Loads this rank's rows of a [V, H] checkpoint tensor into a [V', H] shard, zero padding."""
    start, _, real = vocab_shard(vocab_size, tp, tp_rank)

    @torch.no_grad()
    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"got shard {shard_id} for a parameter that is not fused")
        shape = tuple(loaded.shape)
        if shape != (vocab_size, param.shape[1]):
            raise ValueError(f"expected shape {(vocab_size, param.shape[1])}, got {shape}")
        param.data[real:].zero_()
        if real:
            param.data[:real].copy_(to_dense(take_rows(loaded, start, real), param.dtype))

    return load


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token embedding; the lookup sums the ranks' partial results."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: int, tp_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.start, local, _ = vocab_shard(vocab_size, tp, tp_rank)
        self.local = local
        self.weight = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, vocab_rows_loader(vocab_size, tp, tp_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.local)
        x = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return tp_all_reduce(x)


class ParallelLMHead(nn.Module):
    """This rank's rows of the output projection; logits are all-gathered to the full vocabulary
    on every rank (padding columns dropped)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: int, tp_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        _, local, _ = vocab_shard(vocab_size, tp, tp_rank)
        self.weight = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, vocab_rows_loader(vocab_size, tp, tp_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(F.linear(x, self.weight), dim=-1)[..., : self.vocab_size]


# --- which degrees a model admits --------------------------------------------------------------


def decoder_linear_specs(cfg: ModelConfig, tp: int, dtype: torch.dtype = torch.float32) -> list[LinearSpec]:
    """The split linears of one Llama-style decoder layer under `tp` (rank 0's specs; every rank's
    shapes are the same), as the model builds them: K/V parts widened when KV heads replicate."""
    shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, tp)
    kv = cfg.kv_size * shard.kv_replicas
    h, inter = cfg.hidden_size, cfg.intermediate_size

    def spec(name: str, i: int, sizes: tuple[int, ...], parallel: str) -> LinearSpec:
        return LinearSpec(i, sum(sizes), False, f"layers.0.{name}", sizes, parallel, dtype, 0, tp)  # type: ignore[arg-type]

    return [
        spec("qkv_proj", h, (cfg.q_size, kv, kv), "column"),
        spec("o_proj", cfg.q_size, (h,), "row"),
        spec("gate_up_proj", h, (inter, inter), "column"),
        spec("down_proj", inter, (h,), "row"),
    ]


def tp_problem(
    cfg: ModelConfig, tp: int, alignment: Callable[[LinearSpec], int] = lambda spec: 1
) -> str | None:
    """What in `cfg` does not split over `tp` ranks — its query heads, KV heads, MLP width, or a
    quantizer's shard alignment — as a short phrase ("9 query heads"), or None when it splits."""
    if tp == 1:
        return None
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} query heads"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return f"{cfg.num_kv_heads} KV heads, which tp must divide or be a multiple of"
    if cfg.intermediate_size % tp:
        return f"intermediate size {cfg.intermediate_size}"
    for spec in decoder_linear_specs(cfg, tp):
        align = max(1, int(alignment(spec)))
        wholes = spec.output_sizes if spec.parallel == "column" else (spec.in_features,)
        for whole in wholes:
            if (whole // tp) % align:
                what = "rows" if spec.parallel == "column" else "input columns"
                name = spec.name.removeprefix("layers.0.")
                return (
                    f"{name} would keep {whole // tp} of {whole} {what} per rank, not a multiple of "
                    f"the quantizer's shard alignment {align}"
                )
    return None


def valid_tp_degrees(
    cfg: ModelConfig, alignment: Callable[[LinearSpec], int] = lambda spec: 1, limit: int | None = None
) -> list[int]:
    """The degrees `cfg` splits over (1 included), up to `limit` (default: the query heads)."""
    top = limit or cfg.num_heads
    return [tp for tp in range(1, top + 1) if tp_problem(cfg, tp, alignment) is None]
