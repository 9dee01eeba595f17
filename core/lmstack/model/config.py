"""Architecture hyper-parameters of a decoder, from GGUF metadata or config.json, and what the
checkpoint's weights are stored as."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...}
    # Left out of the hash (dicts are unhashable); still compared.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    # --- Family switches (issue 53): one decoder, a few switches per family. Defaults = Llama.
    # Per-layer sliding windows (None entries: global attention); None: every layer uses
    # `sliding_window` (Mistral). Gemma 2 alternates, Gemma 3 has 5 local : 1 global.
    layer_sliding_windows: tuple[int | None, ...] | None = None
    # RoPE base of the sliding-window (local) layers when it differs from `rope_theta` (Gemma 3).
    rope_local_theta: float | None = None
    # Fraction of head_dim that is rotated (Phi-3 / Phi-4-mini's `partial_rotary_factor`).
    partial_rotary_factor: float = 1.0
    # Attention softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    # tanh soft-capping of attention scores (Gemma 2) and of the final logits (Gemma 2).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorm multiplies by (offset + weight): 1.0 for Gemma's (1 + w) norms.
    norm_weight_offset: float = 0.0
    # Gemma 2 / 3: RMSNorm after attention and around the feed-forward block (pre and post).
    sandwich_norms: bool = False
    # The gated feed-forward's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    hidden_act: str = "silu"
    # Multiplier on the embedding output (Gemma: sqrt(hidden_size), rounded to the model dtype).
    embedding_multiplier: float | None = None
    # Whether o_proj has a bias when attention_bias is set (Qwen2 / Qwen2-MoE bias q, k, v only).
    output_bias: bool = True
    # What the checkpoint stores, for a quantizer to claim: a Hugging Face config.json
    # `quantization_config` as is, or for GGUF {"format": "gguf", "tensor_types": {"Q4_1": 210, ...}}.
    # None: plain floating-point weights.
    quantization: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (all but with a partial factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to the whole context)."""
        if self.layer_sliding_windows is not None:
            return self.layer_sliding_windows[layer]
        return self.sliding_window

    def kv_bytes_per_token(self, kv_dtype_size: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_size * kv_dtype_size
