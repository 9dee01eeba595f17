"""Read a GGUF file: metadata, tensors still packed (`GGUFTensor`), and the Llama architecture's
config parser and tensor adapter.

For Llama, llama.cpp's converter changes two things we undo here (on the packed data: both are
whole-row edits, and GGUF quant blocks never cross a row):
- tensor names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
- the row order of Q and K (and their biases). llama.cpp's default RoPE rotates adjacent pairs
  (x[2i], x[2i+1]) of each head, while Hugging Face's rotates halves (x[i], x[i + d/2]). The
  converter therefore interleaves the two halves of every head's rows; we put them back so the
  weights equal what transformers loads and work with rotate-half RoPE.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lmstack.errors import ConfigError
from lmstack.model.checkpoint import GGUFTensor
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_file import GGUFFile, read_gguf
from lmstack.model.tokenizer import Tokenizer, gguf_eos_token_ids

# Per-layer GGUF tensor name -> Hugging Face name (after `model.layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Not weights: llama.cpp's precomputed llama3 RoPE frequency divisors; they go into the config.
_ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor index (tensors stay in the memory mapping); a file that is
    not GGUF gives a ConfigError."""
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from e


def quantization_description(tensors: Mapping[str, GGUFTensor]) -> dict[str, Any]:
    """`ModelConfig.quantization` of a GGUF file: how many tensors each GGML type stores."""
    return {"format": "gguf", "tensor_types": dict(Counter(t.ggml_type.name for t in tensors.values()))}


def load_gguf_config(
    meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor], name: str = ""
) -> ModelConfig:
    """The Llama architecture's GGUF config parser."""
    arch = meta.get("general.architecture")

    def key(suffix: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{suffix}", default)

    hidden = _required(key("embedding_length"), f"{arch}.embedding_length")
    heads = _required(key("attention.head_count"), f"{arch}.attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; a Llama has one value
        kv_heads = max(kv_heads)
    head_dim = key("attention.key_length", hidden // heads)
    rope_theta = float(key("rope.freq_base", 10000.0))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or _vocab_from(tensors)
    rope_dim = key("rope.dimension_count", head_dim)
    eos = gguf_eos_token_ids(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_required(key("feed_forward_length"), f"{arch}.feed_forward_length")),
        num_layers=int(_required(key("block_count"), f"{arch}.block_count")),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(meta, arch, tensors.get(_ROPE_FREQS), rope_theta, int(rope_dim)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        sliding_window=int(sw) if (sw := key("attention.sliding_window")) else None,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        name=name,
    )


def load_gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def llama_gguf_tensor(
    gguf_name: str, tensor: GGUFTensor, config: ModelConfig
) -> tuple[str, GGUFTensor] | None:
    """The Llama architecture's GGUF tensor adapter: the Hugging Face name, and Q / K (weights and
    biases) with llama.cpp's row interleave undone, still packed. None for `rope_freqs` (it went
    into the config)."""
    if gguf_name == _ROPE_FREQS:
        return None
    hf_name = hf_tensor_name(gguf_name)
    if ".self_attn.q_proj." in hf_name:
        tensor = tensor.take_rows(unpermute_rope_index(tensor.shape[0], config.num_heads))
    elif ".self_attn.k_proj." in hf_name:
        tensor = tensor.take_rows(unpermute_rope_index(tensor.shape[0], config.num_kv_heads))
    return hf_name, tensor


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names are an error."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ConfigError(
        f"GGUF tensor {gguf_name!r} is not part of a Llama model (mixture-of-experts files unsupported)"
    )


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave. w: [n_heads * head_dim, ...] (a weight or a bias).

    llama.cpp wrote, per head, rows in the order (0, d/2, 1, d/2+1, ...): it viewed the head's rows
    as [2, d/2] and transposed. We view them as [d/2, 2] and transpose back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_index(rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K interleave: `w[index] == unpermute_rope_rows(w)`."""
    return unpermute_rope_rows(torch.arange(rows), n_heads)


def _required(value: Any, key: str) -> Any:
    if value is None:
        raise ConfigError(f"GGUF metadata lacks {key}")
    return value


def _vocab_from(tensors: Mapping[str, GGUFTensor]) -> int:
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ConfigError("GGUF file has neither a vocabulary size nor a token_embd.weight tensor")
    return int(embd.shape[0])


# GGUF rope.scaling.* suffix -> Hugging Face rope_scaling key, with its type.
_ROPE_KEYS: dict[str, tuple[str, type]] = {
    "factor": ("factor", float),
    "original_context_length": ("original_max_position_embeddings", int),
    "attn_factor": ("attention_factor", float),
    "yarn_beta_fast": ("beta_fast", float),
    "yarn_beta_slow": ("beta_slow", float),
}


def _rope_scaling(
    meta: Mapping[str, Any], arch: str, rope_freqs: GGUFTensor | None, theta: float, rope_dim: int
) -> dict[str, Any] | None:
    """Hugging Face style rope_scaling from `{arch}.rope.scaling.*`, or from a `rope_freqs` tensor
    (llama.cpp's encoding of Llama 3.1 scaling)."""
    if rope_freqs is not None:
        divisors = rope_freqs.dequantize(torch.float32).double()
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        return fit_llama3_rope_scaling(divisors, theta, rope_dim, original)
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None and (linear := meta.get(f"{arch}.rope.scale_linear")) is not None:
        kind, meta = "linear", {**meta, f"{arch}.rope.scaling.factor": linear}  # older files
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind)}
    for suffix, (hf_key, cast) in _ROPE_KEYS.items():
        if (value := meta.get(f"{arch}.rope.scaling.{suffix}")) is not None:
            scaling[hf_key] = cast(value)
    return scaling


def llama3_rope_divisors(
    theta: float, rope_dim: int, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """Per-frequency divisors [rope_dim // 2] that llama3 scaling applies to the default inverse
    frequencies: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    return 1.0 / ((1 - smooth) / factor + smooth)


def fit_llama3_rope_scaling(
    divisors: torch.Tensor, theta: float, rope_dim: int, original: int | None = None
) -> dict[str, Any] | None:
    """The llama3 rope_scaling parameters that reproduce llama.cpp's `rope_freqs` divisors.

    The file keeps only the divisors, not the parameters our RoPE takes. `factor` is the largest
    divisor; the low/high frequency factors and the original context are searched over the values
    Llama 3.x releases use, and a fit must reproduce every divisor to 1e-4.
    """
    factor = float(divisors.max())
    if math.isclose(factor, 1.0) and math.isclose(float(divisors.min()), 1.0):
        return None
    originals = [original] if original else [8192, 4096, 2048, 16384, 32768, 65536, 131072]
    for ctx in originals:
        for low in (1.0, 2.0, 4.0):
            for high in (4.0, 8.0, 2.0, 16.0, 32.0):
                if high <= low:
                    continue
                expected = llama3_rope_divisors(theta, rope_dim, factor, low, high, int(ctx))
                if torch.allclose(expected, divisors, rtol=1e-4, atol=0):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": int(ctx),
                    }
    raise ConfigError(
        "GGUF rope_freqs tensor does not match any llama3 RoPE scaling; this file is unsupported"
    )
