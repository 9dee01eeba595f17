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

    def kv_bytes_per_token(self, kv_dtype_size: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_size * kv_dtype_size
