"""A Llama-family decoder over a flattened varlen batch and the paged KV cache.

RMSNorm, RoPE (with scaling variants), GQA, SwiGLU, tied or untied head, optional sliding
window. Q/K/V and gate/up are fused projections (fewer ops per layer: batch-1 decode on a CPU
is bound by per-op overhead). Every linear is built through a `LinearFactory`, so a quantizer
can decide what a linear is.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.interfaces import LinearFactory
from lmstack.model.config import ModelConfig
from lmstack.model.rope import RotaryEmbedding, rotate


class AttentionFn(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]."""


def default_linear(in_features: int, out_features: int, bias: bool, name: str) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, linear: LinearFactory) -> None:
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        p = f"layers.{index}."
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = linear(h, self.q_size + 2 * self.kv_size, cfg.attention_bias, p + "qkv_proj")
        self.o_proj = linear(self.q_size, h, cfg.attention_bias, p + "o_proj")
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = linear(h, 2 * cfg.intermediate_size, cfg.mlp_bias, p + "gate_up_proj")
        self.down_proj = linear(cfg.intermediate_size, h, cfg.mlp_bias, p + "down_proj")

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionFn
    ) -> torch.Tensor:
        """x [T, hidden]; rope: the step's cos / sin tables [T, 1, D/2]."""
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        # Q and K heads sit side by side in the fused projection: rotate them in one go.
        qk = rotate(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = attn.attend(self.index, q, k, v)
        x = x + self.o_proj(o.reshape(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, linear: LinearFactory = default_linear, max_positions: int | None = None
    ):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, linear) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The head stays a plain linear: quantizing it costs the most accuracy for the least memory.
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        hidden_state_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, positions: [T]. Returns logits [L, V] (fp32) for rows `logits_indices`
        (all rows when None) and the requested layers' outputs at those rows (layer i = output
        of decoder layer i; num_layers = after the final norm)."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        hidden: dict[int, torch.Tensor] = {}
        want = set(hidden_state_layers)
        for layer in self.layers:
            x = layer(x, rope, attn)
            if layer.index in want:
                hidden[layer.index] = x if logits_indices is None else x[logits_indices]
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        if self.config.num_layers in want:
            hidden[self.config.num_layers] = x
        return self.lm_head(x).float(), hidden

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face Llama-named tensors in, fusing q/k/v and gate/up."""
        cfg = self.config
        own = dict(self.named_parameters())

        def put(name: str, tensor: torch.Tensor) -> None:
            param = own[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            param.copy_(tensor)

        put("embed_tokens.weight", weights["model.embed_tokens.weight"])
        put("norm.weight", weights["model.norm.weight"])
        if not cfg.tie_word_embeddings:
            put("lm_head.weight", weights["lm_head.weight"])
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", weights[src + "input_layernorm.weight"])
            put(dst + "post_attention_layernorm.weight", weights[src + "post_attention_layernorm.weight"])
            att, mlp = src + "self_attn.", src + "mlp."
            put(dst + "qkv_proj.weight", torch.cat([weights[att + f"{p}_proj.weight"] for p in "qkv"]))
            put(dst + "o_proj.weight", weights[att + "o_proj.weight"])
            put(
                dst + "gate_up_proj.weight",
                torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]),
            )
            put(dst + "down_proj.weight", weights[mlp + "down_proj.weight"])
            if cfg.attention_bias:
                put(dst + "qkv_proj.bias", torch.cat([weights[att + f"{p}_proj.bias"] for p in "qkv"]))
                put(dst + "o_proj.bias", weights[att + "o_proj.bias"])
            if cfg.mlp_bias:
                put(
                    dst + "gate_up_proj.bias",
                    torch.cat([weights[mlp + "gate_proj.bias"], weights[mlp + "up_proj.bias"]]),
                )
                put(dst + "down_proj.bias", weights[mlp + "down_proj.bias"])
