"""The decoder of every dense family (Llama 3, Mistral, Qwen2 / 2.5, Qwen3, Phi-3, and the
switches Gemma 2 / 3 need) over a flattened varlen batch and the paged KV cache.

RMSNorm, RoPE (with scaling variants), GQA, SwiGLU, tied or untied head, optional sliding
window; a family differs by the switches of its `ModelConfig` (q/k/v biases, per-head q/k norm,
partial rotary, norm weight offset, sandwich norms, GeGLU, embedding multiplier, final logit
soft-capping, a local RoPE base). Each layer picks its code paths once, when it is built: with
every switch off it runs exactly the Llama ops, with no per-call test of a switch. Per-layer
windows, the attention scale and score soft-capping are the attention kernels' (the model
runner passes them per layer). Q/K/V and gate/up are fused projections (fewer ops per layer:
batch-1 decode on a CPU is bound by per-op overhead); a checkpoint that stores them fused
(Phi-3) is split into the usual parts as it is read. Every decoder linear is built through a `LinearFactory` from a
`LinearSpec`, so a quantizer decides what a linear is and how its weights load; every parameter
carries a weight loader, and `load_weights` feeds them checkpoint tensors as stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks, get_parallel, layer_range, tp_all_reduce
from lmstack.interfaces import LinearFactory, LinearSpec, ParallelHint
from lmstack.model.architecture import (
    AttentionFn,
    GGUFConfigParser,
    GGUFTensorAdapter,
    HFConfigParser,
    ModelArchitecture,
)
from lmstack.model.bounds import table_positions
from lmstack.model.checkpoint import CheckpointTensor, to_dense
from lmstack.model.config import ModelConfig
from lmstack.model.fast_layers import FastLayers, plain_layer
from lmstack.model.gguf_loader import gguf_support
from lmstack.model.hf_loader import parse_llama_config
from lmstack.model.layer_ops import GATED_ACTIVATIONS, qkv_rope_, rms_norm, rotate_, silu_mul
from lmstack.model.linear import default_linear, dense_parameter
from lmstack.model.rope import RotaryEmbedding
from lmstack.model.stages import StageLayers
from lmstack.model.tensor_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    attention_shard,
    expand_kv_heads,
)
from lmstack.model.weight_loader import (
    ShardId,
    WeightLoader,
    default_weight_loader,
    load_named_weights,
    set_weight_loader,
    take_rows,
)


def _callables(*modules: nn.Module) -> Sequence[Callable[..., Any]]:
    """Each module's `forward` where calling the module would run no forward hook (its own or a
    global one), else the module itself. At batch 1 on a CPU `nn.Module.__call__`'s own checks
    cost ~1.5 us a call: ~5 % of a decode step at 7 calls a layer (Zen 3). Hooks still run
    wherever someone registered one. (Backward hooks are left out: inference runs no backward.)"""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return modules
    return [m if m._forward_hooks or m._forward_pre_hooks else m.forward for m in modules]


class RMSNorm(nn.Module):
    """`offset`: the norm multiplies by (offset + stored weight), Gemma's (1 + w). The offset is
    added as the weight loads, so the parameter is the multiplier itself and the forward is the
    Llama one (a tool folding scales into a norm sees the true multiplier too)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = dense_parameter(dim, dtype=dtype)
        if offset:
            set_weight_loader(self.weight, _offset_loader(offset))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The normalised x; with `residual`, first adds it to x in place (x must be a fresh
        tensor the caller owns, e.g. a projection's output) and returns (normalised, x + residual),
        the residual stream a decoder layer carries on. One native call on a CPU in fp32
        (`lmstack.model.layer_ops`)."""
        if residual is not None:
            return rms_norm(x, self.weight, self.eps, residual), x
        return rms_norm(x, self.weight, self.eps)


def _offset_loader(offset: float) -> WeightLoader:
    @torch.no_grad()
    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None = None) -> None:
        # In fp32, then rounded once to the parameter's dtype.
        default_weight_loader(param, to_dense(loaded, torch.float32) + offset, shard_id)

    return load


class DecoderLayer(nn.Module):
    """One decoder layer, or this tensor-parallel rank's shard of it (`ranks.tp` > 1): its query
    and KV heads (`lmstack.model.tensor_parallel.attention_shard`), gate/up columns and down
    rows; o_proj's and down_proj's partial sums are all-reduced over the tp group.

    Family switches (`ModelConfig`) decided here, once: `qk_norm` and a partial rotary factor
    take the general q/k path (`split_qkv`) instead of the one native split-and-rotate call;
    `hidden_act` picks the gated activation; `sandwich_norms` (Gemma) the forward that normalises
    the attention output and the feed-forward block's input and output. Gemma's
    `post_attention_layernorm` is that attention-output norm; Llama's, of the same name, is the
    feed-forward block's input norm (`pre_feedforward_layernorm` in Gemma's naming)."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        linear: LinearFactory,
        dtype: torch.dtype,
        ranks: ParallelRanks | None = None,
    ) -> None:
        super().__init__()
        tp, tp_rank = (ranks.tp, ranks.tp_rank) if ranks is not None else (1, 0)
        shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, tp)
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.ranks = ranks if ranks is not None else ParallelRanks()
        p = f"layers.{index}."

        def spec(name: str, i: int, sizes: tuple[int, ...], bias: bool, parallel: ParallelHint) -> LinearSpec:
            return LinearSpec(i, sum(sizes), bias, p + name, sizes, parallel, dtype, tp_rank, tp)

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset)

        self.input_layernorm = norm(h)
        # Replicated KV heads: the layer tp splits has every KV head repeated per sharing rank.
        kv = cfg.kv_size * shard.kv_replicas
        qkv = (cfg.q_size, kv, kv)
        self.qkv_proj = linear(spec("qkv_proj", h, qkv, cfg.attention_bias, "column"))
        o_bias = cfg.attention_bias and cfg.output_bias
        self.o_proj = linear(spec("o_proj", cfg.q_size, (h,), o_bias, "row"))
        self.post_attention_layernorm = norm(h)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm(h)
            self.post_feedforward_layernorm = norm(h)
            self.forward = self.forward_sandwich  # type: ignore[method-assign]
        self.rotary_dim = cfg.rotary_dim
        # The one native split-and-rotate call where nothing comes between the projection and
        # the rotation of whole heads; else the general path.
        self.split_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = qkv_rope_
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:  # per-head RMSNorm of q and k (one weight of head_dim, shared by the heads)
            self.q_norm = norm(self.head_dim)
            self.k_norm = norm(self.head_dim)
            self.split_qkv = self.split_qkv_general
        elif self.rotary_dim != self.head_dim:
            self.split_qkv = self.split_qkv_general
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]
        self.init_mlp(cfg, linear, dtype)

    def init_mlp(self, cfg: ModelConfig, linear: LinearFactory, dtype: torch.dtype) -> None:
        """The feed-forward block's modules (a mixture-of-experts layer overrides this and `mlp`)."""
        h, inter, p = cfg.hidden_size, cfg.intermediate_size, f"layers.{self.index}."
        tp = (self.ranks.tp_rank, self.ranks.tp)
        self.gate_up_proj = linear(
            LinearSpec(h, 2 * inter, cfg.mlp_bias, p + "gate_up_proj", (inter, inter), "column", dtype, *tp)
        )
        self.down_proj = linear(LinearSpec(inter, h, cfg.mlp_bias, p + "down_proj", (h,), "row", dtype, *tp))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on the normalised residual stream x [T, hidden], summed over
        the tp group."""
        gate_up, down = _callables(self.gate_up_proj, self.down_proj)
        return tp_all_reduce(down(self.act(gate_up(x))))

    def attention(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionFn
    ) -> torch.Tensor:
        """The attention block on the normalised residual stream h [T, hidden]: o_proj's output
        (a fresh tensor), summed over the tp group. Its own method so that offline tools
        (lmstack-calibrate) can run the block alone, as they run `mlp`."""
        qkv_proj, o_proj = _callables(self.qkv_proj, self.o_proj)
        # Q and K heads sit side by side in the fused projection: rotated in one go, in place.
        q, k, v = self.split_qkv(qkv_proj(h), *rope, self.num_heads, self.num_kv_heads)
        o = attn.attend(self.index, q, k, v)
        return tp_all_reduce(o_proj(o.reshape(h.shape[0], self.q_size)))

    def split_qkv_general(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv_rope_` with the switches between the split and the rotation: q and k normalised
        per head (`qk_norm`: fresh tensors), then only the first `rotary_dim` dimensions of each
        head rotated, in place (the tables are that wide)."""
        t, d = qkv.shape[0], self.head_dim
        heads = qkv.view(t, num_heads + 2 * num_kv_heads, d)
        q, k, v = (
            heads[:, :num_heads],
            heads[:, num_heads : num_heads + num_kv_heads],
            heads[:, num_heads + num_kv_heads :],
        )
        if self.q_norm is not None:
            q_norm, k_norm = _callables(self.q_norm, self.k_norm)
            q = q_norm(q.reshape(-1, d)).view(t, num_heads, d)
            k = k_norm(k.reshape(-1, d)).view(t, num_kv_heads, d)
        rotary = self.rotary_dim
        rotate_(q[..., :rotary], cos, sin)
        rotate_(k[..., :rotary], cos, sin)
        return q, k, v

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionFn
    ) -> torch.Tensor:
        """x [T, hidden] (left untouched: a caller may keep it as a layer's hidden state);
        rope: the step's full-width cos / sin tables (`RotaryEmbedding.tables_full`)."""
        norm_in, norm_post = _callables(self.input_layernorm, self.post_attention_layernorm)
        # The residual adds happen in place on o_proj's and down_proj's (fresh) outputs.
        h, x = norm_post(self.attention(norm_in(x), rope, attn), x)
        return self.mlp(h).add_(x)

    def fast_forward(self) -> tuple[Callable[..., torch.Tensor], int, tuple[dict, ...]] | None:
        """`forward` bound once (`lmstack.model.fast_layers`) where every switch is off."""
        own = ("forward", "attention", "mlp")  # not a subclass's (MoE)
        inherited = all(getattr(type(self), f) is getattr(DecoderLayer, f) for f in own)
        switches = self.split_qkv is qkv_rope_ and self.act is silu_mul and "forward" not in vars(self)
        plain = inherited and switches and self.ranks.tp == 1  # vars: Gemma's sandwich forward
        return plain_layer(self) if plain else None

    def forward_sandwich(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionFn
    ) -> torch.Tensor:
        """`forward` with Gemma's sandwich norms: the attention output normalised before the
        residual add, the feed-forward block between a pre- and a post-norm."""
        norm_in, norm_attn_out, norm_pre_ff, norm_post_ff = _callables(
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        # norm_attn_out's output is fresh: the residual add happens in place on it.
        h, x = norm_pre_ff(norm_attn_out(self.attention(norm_in(x), rope, attn)), x)
        return norm_post_ff(self.mlp(h)).add_(x)


class LlamaModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer  # a subclass's own decoder layer (MoE)

    def __init__(
        self,
        cfg: ModelConfig,
        linear: LinearFactory = default_linear,
        *,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        ranks: ParallelRanks | None = None,
    ) -> None:
        """`ranks`: this process's place in a parallel layout (None: a single rank). A pipeline
        stage (`ranks.pp` > 1) builds only its decoder layers (`layer_range`; the others are
        empty placeholders, so layer indices and parameter names stay global); only the first
        stage embeds, only the last has the final norm and the head."""
        super().__init__()
        self.config = cfg
        self.ranks = ranks = ranks or ParallelRanks()
        self.stage = stage = StageLayers(
            *layer_range(cfg.num_layers, ranks.pp, ranks.pp_rank), cfg.num_layers
        )
        shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, ranks.tp)
        self.kv_replicas = shard.kv_replicas
        self.local_num_kv_heads = shard.num_kv_heads  # what this rank's KV cache holds per layer
        self.embed_tokens: nn.Module | None = None
        if stage.first and ranks.tp > 1:  # vocabulary-parallel embedding and head (tensor_parallel.py)
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ranks.tp, ranks.tp_rank, dtype
            )
        elif stage.first:
            # `_weight` skips the random init: the checkpoint overwrites every value.
            self.embed_tokens = nn.Embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                _freeze=True,
            )
            set_weight_loader(self.embed_tokens.weight, default_weight_loader)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, linear, dtype, ranks) if stage.holds(i) else nn.Identity()
            for i in range(cfg.num_layers)
        )
        # Gemma scales the embedding output by sqrt(hidden) rounded to the model dtype (a buffer:
        # it follows the model's device).
        # (register_buffer refuses a name already set as a plain attribute: None goes through it too.)
        scale = cfg.embedding_multiplier
        self.register_buffer(
            "embed_scale", None if scale is None else torch.tensor(scale, dtype=dtype), persistent=False
        )
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Module | None = None
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset)
            # The head stays a dense linear: quantizing it costs the most accuracy for the least memory.
            if ranks.tp > 1:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ranks.tp, ranks.tp_rank, dtype)
            else:
                self.lm_head = default_linear(
                    LinearSpec(
                        cfg.hidden_size,
                        cfg.vocab_size,
                        False,
                        "lm_head",
                        parallel="column",
                        params_dtype=dtype,
                    )
                )
            # Tied: the head shares the embedding; a last stage without one loads the embedding
            # tensor into its head (`StageLayers.param_name`).
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        positions = max_positions or table_positions(cfg.max_position_embeddings, None)
        self.rope = RotaryEmbedding(cfg.rotary_dim, positions, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: the sliding-window layers rotate with their own base (and no scaling). Which
        # table each layer takes is fixed here (`forward` indexes the step's tables by it).
        self.local_rope: RotaryEmbedding | None = None
        self.rope_slots = (0,) * cfg.num_layers
        if cfg.rope_local_theta is not None:
            self.local_rope = RotaryEmbedding(cfg.rotary_dim, positions, cfg.rope_local_theta, None)
            self.rope_slots = tuple(int(cfg.layer_window(i) is not None) for i in range(cfg.num_layers))
        self.final_logit_softcap = cfg.final_logit_softcap
        self._fast_layers: FastLayers | None = None  # `bind_fast_layers`

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        hidden_state_layers: tuple[int, ...] = (),
        *,
        hidden_in: torch.Tensor | None = None,
        hidden_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, positions: [T]. Returns logits [L, V] (fp32) for rows `logits_indices`
        (all rows when None) and the requested layers' outputs at those rows (layer i = output
        of decoder layer i; num_layers = after the final norm).

        A pipeline stage after the first takes the previous stage's output as `hidden_in`
        [T, hidden] instead of embedding `input_ids`; a stage before the last returns its
        layers' output [T, hidden] (every row: the next stage needs them all) in place of logits.
        `hidden_rows`: return the layers' outputs at these rows instead of `logits_indices`."""
        stage = self.stage
        x = hidden_in if hidden_in is not None else self.embed(input_ids)
        ropes = (self.rope.tables_full(positions, x.dtype),)
        if self.local_rope is not None:
            ropes += (self.local_rope.tables_full(positions, x.dtype),)
        hidden: dict[int, torch.Tensor] = {}
        want = set(hidden_state_layers)
        rows = hidden_rows if hidden_rows is not None else logits_indices
        # islice, not `self.layers[start:end]`: slicing a ModuleList builds a new one (~130 us).
        layers = tuple(islice(self.layers, stage.start, stage.end))
        slots = self.rope_slots[stage.start : stage.end]
        calls = (self._fast_layers and self._fast_layers.for_step(x)) or _callables(*layers)
        for layer, call, slot in zip(layers, calls, slots):
            x = call(x, ropes[slot], attn)
            if layer.index in want:
                hidden[layer.index] = x if rows is None else x[rows]
        if self.lm_head is None:
            return x, hidden
        if hidden_rows is not None and self.config.num_layers in want:
            hidden[self.config.num_layers] = self.norm(x[hidden_rows])
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        if self.config.num_layers in want and hidden_rows is None:
            hidden[self.config.num_layers] = x
        return self.logits(x), hidden

    def bind_fast_layers(self) -> bool:
        """Bind the layers' fast path (the runner calls this after `process_model`): True if all have one."""
        self._fast_layers = FastLayers.bind(islice(self.layers, self.stage.start, self.stage.end))
        return self._fast_layers is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] that enter the first layer (times the embedding
        multiplier where the family has one)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x.mul_(self.embed_scale)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [L, V] of final-normed hidden states [L, hidden] (tanh soft-capped where
        the family caps them: Gemma 2)."""
        logits = self.lm_head(x).float()
        if (cap := self.final_logit_softcap) is not None:
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Hugging Face Llama-named checkpoint tensors into the parameters' weight loaders."""
        weights = self.checkpoint_tensors(weights)
        cfg, stage = self.config, self.stage
        load_named_weights(
            self,
            weights,
            lambda name: stage.param_name(llama_checkpoint_name(name, cfg), tied=cfg.tie_word_embeddings),
        )

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors in the Llama layout this model loads: fused q/k/v and gate/up
        tensors (Phi-3) split into their parts, and KV heads replicated for tp."""
        weights = self._split_fused(weights)
        return self._replicate_kv_heads(weights) if self.kv_replicas > 1 else weights

    def _split_fused(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """`self_attn.qkv_proj.weight` -> q_proj / k_proj / v_proj tensors (rows of it, still as
        stored: views or packed GGUF rows), `mlp.gate_up_proj.weight` -> gate_proj / up_proj; the
        same for biases. Any other tensor of a fused module (a quantizer's, packed along other
        axes) goes to the fused parameter whole."""
        cfg = self.config
        parts = {
            "qkv_proj": (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
        }
        for name, tensor in weights:
            m = _LAYER_TENSOR.search(name)
            if m is None or m.group(2) not in parts or m.group(3) not in ("weight", "bias"):
                yield name, tensor
                continue
            sizes = parts[m.group(2)]
            rows = tuple(tensor.shape)[0]
            if rows != sum(n for _, n in sizes):
                raise ConfigError(
                    f"checkpoint tensor {name!r} has {rows} rows; the config's "
                    + " + ".join(f"{part} {n}" for part, n in sizes)
                    + f" make {sum(n for _, n in sizes)}"
                )
            prefix, start = name[: m.start(2)], 0
            for part, n in sizes:
                yield f"{prefix}{part}.{m.group(3)}", take_rows(tensor, start, n)
                start += n

    def _replicate_kv_heads(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """k_proj / v_proj tensors with each KV head repeated for the ranks that share it (see
        DecoderLayer). Only row-major tensors (dense or GGUF weight / bias) have heads on rows."""
        for name, tensor in weights:
            if m := _LAYER_TENSOR.search(name):
                module, suffix = m.group(2), m.group(3)
                if module in ("k_proj", "v_proj"):
                    if suffix not in ("weight", "bias"):
                        raise ConfigError(
                            f"checkpoint tensor {name!r}: tp={self.ranks.tp} replicates the "
                            f"{self.config.num_kv_heads} KV heads, which works for dense and GGUF "
                            "weights only; pick a tp that divides the KV heads"
                        )
                    tensor = expand_kv_heads(tensor, self.config.num_kv_heads, self.kv_replicas)
            yield name, tensor


# Checkpoint module -> (our fused module, shard id = index in its LinearSpec.output_sizes).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(.+)")


def llama_checkpoint_name(name: str, config: ModelConfig) -> tuple[str, ShardId | None] | None:
    """`model.layers.3.self_attn.k_proj.<suffix>` -> (`layers.3.qkv_proj.<suffix>`, 1). The suffix
    is kept, so a quantizer's own tensors (`qweight`, `weight_scale`, ...) reach the parameters of
    the same name on its linear. None for tensors the model does not load."""
    if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
        return None
    if name.startswith("lm_head."):
        return None if config.tie_word_embeddings else (name, None)
    name = name.removeprefix("model.")
    if m := _LAYER_TENSOR.fullmatch(name):
        layer, module, suffix = m.groups()
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return f"layers.{layer}.{fused}.{suffix}", shard
        return f"layers.{layer}.{module}.{suffix}", None
    return name, None


def build_llama(
    config: ModelConfig,
    linear: LinearFactory,
    *,
    dtype: torch.dtype,
    max_positions: int,
    ranks: ParallelRanks | None = None,
) -> LlamaModel:
    """`ranks` defaults to this process's (`lmstack.exec.distributed.get_parallel`): a worker of a
    parallel layout builds its shard (or its pipeline stage), any other process the whole model."""
    return LlamaModel(
        config, linear, dtype=dtype, max_positions=max_positions, ranks=ranks or get_parallel().ranks
    )


def decoder_architecture(
    name: str,
    hf_architectures: tuple[str, ...],
    parse_hf_config: HFConfigParser,
    description: str,
    *,
    hf_model_types: tuple[str, ...] = (),
    gguf_architectures: tuple[str, ...] = (),
    parse_gguf_config: GGUFConfigParser | None = None,
    gguf_tensor: GGUFTensorAdapter | None = None,
) -> ModelArchitecture:
    """A family of the one decoder: its checkpoint names and config parser (which sets its
    switches); the model and the weight mapping are this module's for every family."""
    return ModelArchitecture(
        name=name,
        build=build_llama,
        checkpoint_name=llama_checkpoint_name,
        hf_architectures=hf_architectures,
        hf_model_types=hf_model_types or (name,),
        parse_hf_config=parse_hf_config,
        gguf_architectures=gguf_architectures,
        parse_gguf_config=parse_gguf_config,
        gguf_tensor=gguf_tensor,
        description=description,
    )


ARCHITECTURE = decoder_architecture(
    "llama",
    ("LlamaForCausalLM", "MistralForCausalLM"),
    parse_llama_config,
    "Llama 2 / 3.x and Mistral decoder (GQA, SwiGLU, RoPE scaling incl. llama3, optional sliding window)",
    hf_model_types=("llama", "mistral"),
    **gguf_support("llama"),
)
