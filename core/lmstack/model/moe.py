"""A mixture-of-experts decoder: the dense decoder's attention with a routed-experts feed-forward
block.

Mixtral style: a router (a dense linear to one logit per expert) -> softmax -> top-k ->
renormalised weights, each expert a SwiGLU MLP. Qwen2-MoE style options: `norm_topk_prob`
off (the top-k probabilities are used as they are), a shared expert every token passes through,
scaled by a sigmoid gate, and layers that keep a dense MLP. Qwen3-MoE: Qwen3's attention (per-head
q/k norm) with Qwen2-MoE's routing options and no shared expert.

Attention, norms, embedding and head are the dense decoder's classes with their family switches
(`MoEDecoderLayer` overrides only the feed-forward block). The MoE layer is the torch reference: a loop over this rank's experts,
each taking its tokens with `index_select` and adding its weighted output back with
`index_add_`. Experts are `LinearFactory` linears (one per expert, so a quantizer treats them as
any other linear); the router and the shared expert's gate stay dense, as the head does
(quantizing a router changes which experts run).

Expert parallelism (`lmstack.exec.distributed`): every ep rank sees every token and routes it the
same way (the router is replicated), holds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep),
each split tp-ways inside its tp group, and the layer's output is its partial sum, reduced over
the moe group (ep x tp ranks). The shared expert is computed by ep rank 0 only, so the sum counts
it once. On one rank every collective is a no-op.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks, get_parallel, moe_all_reduce, shard_range
from lmstack.interfaces import LinearFactory, LinearSpec
from lmstack.model.architecture import ModelArchitecture
from lmstack.model.checkpoint import CheckpointTensor
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_loader import gguf_support
from lmstack.model.hf_loader import parse_llama_config, parse_qwen2_config, parse_qwen3_config
from lmstack.model.linear import default_linear
from lmstack.model.llama import DecoderLayer, LlamaModel, llama_checkpoint_name
from lmstack.model.weight_loader import ShardId, load_named_weights


@dataclasses.dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A Llama config plus the expert block's hyper-parameters. `intermediate_size` stays the
    dense MLP's width (layers in `dense_layers`); each routed expert is `moe_intermediate_size`
    wide."""

    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts

    def local_experts(self, ranks: ParallelRanks) -> range:
        """The experts an ep rank holds: a contiguous block, num_experts / ep of them."""
        return range(*shard_range(self.num_experts, ranks.ep, ranks.ep_rank))


def valid_ep_degrees(num_experts: int) -> list[int]:
    return [d for d in range(1, num_experts + 1) if num_experts % d == 0]


class Expert(nn.Module):
    """A SwiGLU MLP (gate and up fused, as in the Llama MLP), tp-split inside the tp group: its
    output is this tp rank's partial sum."""

    def __init__(
        self,
        name: str,
        hidden: int,
        inter: int,
        linear: LinearFactory,
        dtype: torch.dtype,
        ranks: ParallelRanks,
    ) -> None:
        super().__init__()
        # SwiGLU: `_moe_config` refuses a MoE config with any other activation.
        tp = {"tp_rank": ranks.tp_rank, "tp_size": ranks.tp}
        self.gate_up_proj = linear(
            LinearSpec(
                hidden, 2 * inter, False, f"{name}.gate_up_proj", (inter, inter), "column", dtype, **tp
            )
        )
        self.down_proj = linear(
            LinearSpec(inter, hidden, False, f"{name}.down_proj", (hidden,), "row", dtype, **tp)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Router, this rank's experts and (on ep rank 0) the shared expert; returns the block's
    output summed over the moe group."""

    def __init__(
        self, cfg: MoEConfig, prefix: str, linear: LinearFactory, dtype: torch.dtype, ranks: ParallelRanks
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = default_linear(
            LinearSpec(h, cfg.num_experts, False, f"{prefix}.gate", params_dtype=dtype)
        )
        self.local = cfg.local_experts(ranks)
        # Keyed by the global expert id: parameter names match the checkpoint's on every rank.
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(f"{prefix}.experts.{e}", h, cfg.moe_intermediate_size, linear, dtype, ranks)
                for e in self.local
            }
        )
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: nn.Module | None = None
        if cfg.shared_expert_intermediate_size and ranks.ep_rank == 0:
            inter = cfg.shared_expert_intermediate_size
            self.shared_expert = Expert(f"{prefix}.shared_expert", h, inter, linear, dtype, ranks)
            self.shared_expert_gate = default_linear(
                LinearSpec(h, 1, False, f"{prefix}.shared_expert_gate", params_dtype=dtype)
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in self.local:
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = self.experts[str(e)](x.index_select(0, token))
            # Weight in fp32, as the reference does, then back to the stream's dtype.
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return moe_all_reduce(out)


class MoEDecoderLayer(DecoderLayer):
    """The Llama decoder layer with a `SparseMoE` feed-forward block (or the dense MLP on the
    layers the config keeps dense)."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        linear: LinearFactory,
        dtype: torch.dtype,
        ranks: ParallelRanks | None = None,
    ) -> None:
        super().__init__(cfg, index, linear, dtype, ranks)
        assert isinstance(cfg, MoEConfig)

    def init_mlp(self, cfg: ModelConfig, linear: LinearFactory, dtype: torch.dtype) -> None:
        assert isinstance(cfg, MoEConfig)
        self.moe: SparseMoE | None = None
        if self.index in cfg.dense_layers:
            super().init_mlp(cfg, linear, dtype)
        else:
            self.moe = SparseMoE(cfg, f"layers.{self.index}.moe", linear, dtype, self.ranks)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(x) if self.moe is None else self.moe(x)


class MoEModel(LlamaModel):
    layer_class = MoEDecoderLayer

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Hugging Face Mixtral / Qwen2-MoE named tensors; other ep ranks' experts (and, off ep
        rank 0, the shared expert) are skipped."""
        config = self.config
        assert isinstance(config, MoEConfig)
        local = set(config.local_experts(self.ranks))
        shared_here = self.ranks.ep_rank == 0

        stage = self.stage  # a pipeline stage skips other stages' tensors

        def name_map(name: str) -> tuple[str, ShardId | None] | None:
            target = stage.param_name(moe_checkpoint_name(name, config), tied=config.tie_word_embeddings)
            if target is None:
                return None
            if (m := _EXPERT_PARAM.match(target[0])) and int(m.group(1)) not in local:
                return None
            if not shared_here and _SHARED_PARAM.match(target[0]):
                return None
            return target

        # Fused dense tensors split, KV heads replicated for tp above the KV heads (LlamaModel).
        load_named_weights(self, self.checkpoint_tensors(weights), name_map)


_EXPERT_PARAM = re.compile(r"layers\.\d+\.moe\.experts\.(\d+)\.")
_SHARED_PARAM = re.compile(r"layers\.\d+\.moe\.shared_expert")
# Checkpoint expert module -> (our module, shard id in its fused projection), per naming style.
_EXPERT_PARTS = {
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
_MOE_TENSOR = re.compile(
    r"(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\."
    r"(?:(gate|shared_expert_gate)|experts\.(\d+)\.(\w+)|shared_expert\.(\w+))\.(\w+)"
)


def moe_checkpoint_name(name: str, config: ModelConfig) -> tuple[str, ShardId | None] | None:
    """`model.layers.1.block_sparse_moe.experts.3.w3.weight` -> (`layers.1.moe.experts.3.
    gate_up_proj.weight`, 1); Qwen2-MoE's `mlp.experts.{e}.gate_proj` / `mlp.shared_expert.*` /
    `mlp.shared_expert_gate` alike; every other tensor as the Llama mapping names it."""
    m = _MOE_TENSOR.fullmatch(name)
    if m is None:
        return llama_checkpoint_name(name, config)
    layer, router, expert, expert_part, shared_part, suffix = m.groups()
    p = f"layers.{layer}.moe."
    if router is not None:
        return f"{p}{router}.{suffix}", None
    part = expert_part if expert is not None else shared_part
    if part not in _EXPERT_PARTS:
        raise ConfigError(f"checkpoint tensor {name!r}: unknown expert projection {part!r}")
    module, shard = _EXPERT_PARTS[part]
    owner = f"experts.{expert}" if expert is not None else "shared_expert"
    return f"{p}{owner}.{module}.{suffix}", shard


def _moe_config(base: ModelConfig, **moe: Any) -> MoEConfig:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    cfg = MoEConfig(**fields, **moe)
    if cfg.hidden_act != "silu":
        raise ConfigError(
            f"config.json of model {base.name!r}: experts with activation {cfg.hidden_act!r} are not "
            "implemented (implemented: silu)"
        )
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError(
            f"config.json of model {base.name!r}: num_experts_per_tok {cfg.num_experts_per_tok} outside "
            f"1..{cfg.num_experts}"
        )
    return cfg


def parse_mixtral_config(cfg: Mapping[str, Any], name: str = "") -> MoEConfig:
    base = parse_llama_config(cfg, name)
    return _moe_config(
        base,
        num_experts=int(cfg.get("num_local_experts", 8)),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
        moe_intermediate_size=base.intermediate_size,
    )


def _qwen_moe_fields(cfg: Mapping[str, Any], base: ModelConfig, norm_topk_prob: bool) -> dict[str, Any]:
    """The expert block of Qwen2-MoE / Qwen3-MoE configs (their defaults differ only in
    `norm_topk_prob`)."""
    num_layers, step = base.num_layers, int(cfg.get("decoder_sparse_step", 1))
    # A layer has experts when it is not listed as MLP-only and (index + 1) is a multiple of the step.
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    # transformers 5 writes `num_local_experts` (its attribute map), the published configs `num_experts`.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    # No defaults for the expert block's sizes: transformers' differ between the two families,
    # and a guess would only fail later, at load, against the tensors' shapes.
    for key, value in (
        ("num_experts", num_experts),
        ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
        ("moe_intermediate_size", cfg.get("moe_intermediate_size")),
    ):
        if value is None:
            raise ConfigError(f"config.json of model {base.name!r} lacks {key!r}")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_prob)),
        dense_layers=dense,
    )


def parse_qwen2_moe_config(cfg: Mapping[str, Any], name: str = "") -> MoEConfig:
    # Qwen2's attention: q/k/v biased (unless `qkv_bias` says not), o_proj never.
    base = parse_qwen2_config(cfg, name)
    base = dataclasses.replace(base, attention_bias=bool(cfg.get("qkv_bias", True)))
    return _moe_config(
        base,
        **_qwen_moe_fields(cfg, base, norm_topk_prob=False),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def parse_qwen3_moe_config(cfg: Mapping[str, Any], name: str = "") -> MoEConfig:
    """Qwen3-MoE: Qwen3's attention (per-head q/k norm), routed experts with no shared expert."""
    if cfg.get("shared_expert_intermediate_size"):
        raise ConfigError(
            f"config.json of model {name!r}: a Qwen3-MoE shared expert is not implemented "
            "(transformers' Qwen3-MoE has none)"
        )
    base = parse_qwen3_config(cfg, name)
    return _moe_config(base, **_qwen_moe_fields(cfg, base, norm_topk_prob=False))


def build_moe(
    config: ModelConfig, linear: LinearFactory, *, dtype: torch.dtype, max_positions: int
) -> MoEModel:
    if not isinstance(config, MoEConfig):
        raise ConfigError(f"model {config.name!r} has no mixture-of-experts config")
    return MoEModel(config, linear, dtype=dtype, max_positions=max_positions, ranks=get_parallel().ranks)


MIXTRAL = ModelArchitecture(
    name="mixtral",
    build=build_moe,
    checkpoint_name=moe_checkpoint_name,
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    parse_hf_config=parse_mixtral_config,
    description="Mixtral mixture-of-experts decoder (Llama attention, top-k routed SwiGLU experts)",
)

QWEN2_MOE = ModelArchitecture(
    name="qwen2_moe",
    build=build_moe,
    checkpoint_name=moe_checkpoint_name,
    hf_architectures=("Qwen2MoeForCausalLM",),
    hf_model_types=("qwen2_moe",),
    parse_hf_config=parse_qwen2_moe_config,
    description="Qwen2-MoE decoder (q/k/v bias, top-k routed experts plus a sigmoid-gated shared expert)",
)

QWEN3_MOE = ModelArchitecture(
    name="qwen3_moe",
    build=build_moe,
    checkpoint_name=moe_checkpoint_name,
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    parse_hf_config=parse_qwen3_moe_config,
    **gguf_support("qwen3moe"),
    description="Qwen3-MoE decoder (per-head q/k RMSNorm, top-k routed experts)",
)

MOE_ARCHITECTURES: tuple[ModelArchitecture, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
