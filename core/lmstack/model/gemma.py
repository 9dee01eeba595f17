"""Gemma 2 and Gemma 3 (text) from Hugging Face folders: config.json into the one decoder's
switches (`lmstack.model.llama`); the model and its weight mapping are the decoder's own.

What makes a Gemma, as transformers computes it: RMSNorm multiplying by (1 + weight), a GeGLU
feed-forward block (gelu_pytorch_tanh), sandwich norms (the attention output normalised before
the residual add, the feed-forward block between a pre- and a post-norm), the embedding output
times sqrt(hidden_size), tied embeddings, a softmax scale of query_pre_attn_scalar ** -0.5, and
layers that alternate sliding-window (local) and global attention: Gemma 2 every other layer,
with tanh soft-capping of the attention scores and of the final logits; Gemma 3 five local to
one global, with per-head q/k RMSNorm and its own RoPE base on the local layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmstack.errors import ConfigError
from lmstack.model.architecture import ModelArchitecture
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_loader import gguf_support
from lmstack.model.hf_loader import hf_rope, layer_windows, parse_decoder_config
from lmstack.model.llama import decoder_architecture

SLIDING, FULL = "sliding_attention", "full_attention"


def _where(name: str) -> str:
    return f"config.json of model {name!r}"


def _need(cfg: Mapping[str, Any], key: str, name: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"{_where(name)} lacks {key!r}, which Gemma needs")
    return cfg[key]


def _layer_types(cfg: Mapping[str, Any], name: str, default_pattern: int) -> list[str]:
    """Each layer's attention type: `layer_types` as the config lists them, else what
    transformers derives for configs written before that key existed: every `pattern`-th layer
    global, the others local (Gemma 2: pattern 2, layer 0 local; Gemma 3:
    `sliding_window_pattern`, 6 by default)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern
    layers = int(_need(cfg, "num_hidden_layers", name))
    return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers)]


def _gemma_switches(cfg: Mapping[str, Any], name: str, default_pattern: int) -> dict[str, Any]:
    """The switches Gemma 2 and 3 share."""
    if cfg.get("use_bidirectional_attention"):  # EmbeddingGemma: an encoder, not a decoder
        raise ConfigError(
            f"{_where(name)}: use_bidirectional_attention (an embedding model) is not implemented"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    hidden = int(_need(cfg, "hidden_size", name))
    types = _layer_types(cfg, name, default_pattern)
    if SLIDING in types:
        _need(cfg, "sliding_window", name)
    return {
        "hidden_act": str(act),
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": hidden**0.5,
        # transformers' Gemma configs tie the head by default.
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "attn_scale": float(_need(cfg, "query_pre_attn_scalar", name)) ** -0.5,
        "attn_logit_softcap": _cap(cfg.get("attn_logit_softcapping")),
        "final_logit_softcap": _cap(cfg.get("final_logit_softcapping")),
        **layer_windows({**cfg, "layer_types": types}, name),
    }


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def parse_gemma2_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Gemma 2: local and global layers alternating (layer 0 local), attention scores and
    final logits soft-capped (50 and 30 in the published models)."""
    return parse_decoder_config(cfg, name, **_gemma_switches(cfg, name, default_pattern=2))


def parse_gemma3_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): five local layers to one
    global, per-head q/k RMSNorm, the global layers' RoPE (maybe scaled) and the local layers'
    own base: transformers 5's per-layer-type `rope_parameters`, or the older `rope_theta` +
    `rope_scaling` for the global layers and `rope_local_base_freq` for the local ones."""
    switches = _gemma_switches(cfg, name, default_pattern=6)
    params = cfg.get("rope_parameters") or {}
    per_type = bool(params) and all(isinstance(v, Mapping) for v in params.values())
    if per_type:
        if SLIDING not in params or FULL not in params:
            raise ConfigError(f"{_where(name)}: rope_parameters lacks {SLIDING!r} or {FULL!r}")
        theta, scaling = hf_rope(cfg, FULL)
        local_theta, local_scaling = hf_rope(cfg, SLIDING)
        if local_scaling is not None:  # the decoder's local RoPE takes a base only
            raise ConfigError(
                f"{_where(name)}: RoPE scaling {local_scaling.get('rope_type')!r} on the sliding-window "
                "layers is not implemented (only on the global layers)"
            )
    else:
        theta, scaling = hf_rope(cfg)
        local_theta = float(_need(cfg, "rope_local_base_freq", name))
    return parse_decoder_config(
        cfg,
        name,
        **switches,
        qk_norm=True,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
    )


GEMMA2 = decoder_architecture(
    "gemma2",
    ("Gemma2ForCausalLM",),
    parse_gemma2_config,
    "Gemma 2 decoder (GeGLU, (1 + w) and sandwich norms, soft-capped scores and logits, local/global layers)",
    hf_model_types=("gemma2",),
    **gguf_support("gemma2"),
)
GEMMA3 = decoder_architecture(
    "gemma3",
    ("Gemma3ForCausalLM",),
    parse_gemma3_config,
    "Gemma 3 text decoder (Gemma 2's layers with q/k norm, 5 local : 1 global, local RoPE base)",
    hf_model_types=("gemma3_text",),
    **gguf_support("gemma3"),
)
# Multimodal Gemma 3 (Gemma3ForConditionalGeneration) is left out: the registry refuses it in
# one line naming the architectures served, Gemma3ForCausalLM (its text-only models) among them.
ARCHITECTURES: tuple[ModelArchitecture, ...] = (GEMMA2, GEMMA3)
