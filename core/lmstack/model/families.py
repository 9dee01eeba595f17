"""The dense families of the one decoder (`lmstack.model.llama`), one entry each: their
checkpoint names and config parsers; `lmstack.components.builtins` registers these, Gemma's
(`lmstack.model.gemma`) and the mixture-of-experts ones (`lmstack.model.moe`)."""

from __future__ import annotations

from lmstack.model.architecture import ModelArchitecture
from lmstack.model.gguf_loader import gguf_support
from lmstack.model.hf_loader import parse_phi3_config, parse_qwen2_config, parse_qwen3_config
from lmstack.model.llama import ARCHITECTURE, decoder_architecture

DECODER_ARCHITECTURES: tuple[ModelArchitecture, ...] = (
    ARCHITECTURE,
    decoder_architecture(
        "qwen2",
        ("Qwen2ForCausalLM",),
        parse_qwen2_config,
        "Qwen2 / Qwen2.5 decoder (q/k/v biases)",
        **gguf_support("qwen2"),
    ),
    decoder_architecture(
        "qwen3",
        ("Qwen3ForCausalLM",),
        parse_qwen3_config,
        "Qwen3 decoder (per-head q/k RMSNorm)",
        **gguf_support("qwen3"),
    ),
    decoder_architecture(
        "phi3",
        ("Phi3ForCausalLM",),
        parse_phi3_config,
        "Phi-3 / Phi-3.5 / Phi-4-mini decoder (fused qkv and gate_up tensors, LongRoPE, partial rotary)",
        **gguf_support("phi3"),
    ),
)
