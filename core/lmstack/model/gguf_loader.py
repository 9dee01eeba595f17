"""Read a GGUF file: metadata, tensors still packed (`GGUFTensor`), and the config parser and
tensor adapter of every architecture llama.cpp's converter writes that lmstack serves
(`general.architecture` llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3).

A GGUF file holds what llama.cpp runs, not the Hugging Face checkpoint it came from. The
converter (llama.cpp's convert_hf_to_gguf.py) renames tensors, moves some hyper-parameters into
`<arch>.*` metadata keys and leaves others to be implied by the architecture, and edits a few
tensors. Here each architecture (`GGUFFamily`) says how to go back, so the models load a GGUF
file through the same Hugging Face names and `ModelConfig` switches as the folder it came from:

- names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`;
- llama only: the row order of Q and K (and their biases). llama.cpp's `llama` graph rotates
  adjacent pairs (x[2i], x[2i+1]) of each head, Hugging Face's rotate-half pairs (x[i],
  x[i + d/2]); the converter interleaves the two halves of every head's rows, and we put them
  back (on the packed data: a whole-row edit, and GGUF quant blocks never cross a row). The
  other families run llama.cpp's NEOX (rotate-half) RoPE and are stored unpermuted;
- gemma2 / gemma3: every RMSNorm weight is stored as 1 + w (llama.cpp's norm multiplies by the
  weight; Gemma's by 1 + weight); we subtract the 1 again;
- qwen3moe: each layer's experts are stacked into one [experts, rows, cols] tensor per
  projection; we give them back one expert at a time;
- phi3: Hugging Face's fused qkv_proj / gate_up_proj stay fused (`attn_qkv`, `ffn_up`); the
  LongRoPE factors are tensors (`rope_factors_long/short.weight`) and go into the config, as
  does llama 3.1's `rope_freqs.weight`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from lmstack.errors import ConfigError
from lmstack.model.checkpoint import GGUFTensor
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_file import GGUFFile, read_gguf
from lmstack.model.gguf_rope import gguf_rope_scaling
from lmstack.model.rope import check_rope_scaling
from lmstack.model.tokenizer import Tokenizer, gguf_eos_token_ids

# Per-layer GGUF tensor name (between `blk.{i}.` and `.weight` / `.bias`) -> Hugging Face module
# (after `model.layers.{i}.`), shared by the families; a family lists which it stores.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the feed-forward block.
_SANDWICH_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Stacked experts [experts, rows, cols] -> the per-expert Hugging Face projection.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Not weights: llama.cpp's precomputed RoPE frequency divisors (llama 3.1) and Phi-3's LongRoPE
# factors; they go into the config.
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_CONFIG_TENSORS = frozenset({_ROPE_FREQS, *_ROPE_FACTORS})

_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
_DENSE_FFN = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def _f32(value: Any) -> float:
    """A float metadata value (stored as float32) as the shortest decimal that rounds to it:
    1e-05, not 9.999999747378752e-06, as config.json spells it (the same float32 either way)."""
    return float(str(np.float32(value)))


class _Keys:
    """`<arch>.<suffix>` metadata of one file; `need` is the one-line error for a missing key."""

    def __init__(self, meta: Mapping[str, Any], arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, suffix: str, default: Any = None) -> Any:
        value = self.meta.get(f"{self.arch}.{suffix}")
        return default if value is None else value

    def need(self, suffix: str) -> Any:
        value = self.meta.get(f"{self.arch}.{suffix}")
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {self.arch}.{suffix}, which a {self.arch} model needs")
        return value


FamilyFields = Callable[[_Keys, Mapping[str, GGUFTensor], dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class GGUFFamily:
    """How llama.cpp stores one `general.architecture`: the layer tensors it writes, the
    conversion edits to undo, and the ModelConfig switches its metadata (or the architecture
    itself) implies."""

    arch: str
    layer_tensors: tuple[str, ...]
    fields: FamilyFields
    permuted_qk: bool = False  # llama: Q / K rows interleaved for llama.cpp's pairwise RoPE
    norm_plus_one: bool = False  # gemma: RMSNorm weights stored as 1 + w
    sandwich_norms: bool = False  # gemma: ffn_norm is the pre-feed-forward norm, plus post norms
    fused_gate_up: bool = False  # phi3: ffn_up holds Hugging Face's fused gate_up_proj
    experts: bool = False  # qwen3moe: stacked expert tensors
    # What a tensor outside `layer_tensors` most likely means, for the error.
    hint: str = ""

    def tensor(
        self, gguf_name: str, tensor: GGUFTensor, config: ModelConfig
    ) -> tuple[str, GGUFTensor] | list[tuple[str, GGUFTensor]] | None:
        """This architecture's GGUF tensor adapter (`ModelArchitecture.gguf_tensor`): the Hugging
        Face name and the tensor with llama.cpp's edits undone, still packed where the edit is a
        row selection; a list of them for a tensor that stacks several (qwen3moe experts); None
        for the tensors that went into the config."""
        if gguf_name in _CONFIG_TENSORS:
            return None
        parts = gguf_name.split(".")
        if self.experts and len(parts) == 4 and parts[2] in _EXPERT_NAMES and parts[3] == "weight":
            if len(tensor.shape) != 3:
                raise ConfigError(
                    f"GGUF tensor {gguf_name!r} is not a stack of experts (shape {tensor.shape})"
                )
            p = f"model.layers.{parts[1]}.mlp.experts"
            return [
                (f"{p}.{e}.{_EXPERT_NAMES[parts[2]]}.weight", _expert(tensor, e))
                for e in range(tensor.shape[0])
            ]
        hf_name = self.hf_name(gguf_name)
        if self.permuted_qk:
            if ".self_attn.q_proj." in hf_name:
                tensor = tensor.take_rows(unpermute_rope_index(tensor.shape[0], config.num_heads))
            elif ".self_attn.k_proj." in hf_name:
                tensor = tensor.take_rows(unpermute_rope_index(tensor.shape[0], config.num_kv_heads))
        if self.norm_plus_one and hf_name.endswith("norm.weight"):
            tensor = _minus_one(tensor)
        return hf_name, tensor

    def hf_name(self, gguf_name: str) -> str:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a tensor this
        architecture does not have is a one-line error."""
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
            module = parts[2]
            if module in self.layer_tensors and module not in _EXPERT_NAMES:
                if self.sandwich_norms and module in _SANDWICH_NAMES:
                    hf = _SANDWICH_NAMES[module]
                elif self.fused_gate_up and module == "ffn_up":
                    hf = "mlp.gate_up_proj"
                else:
                    hf = _LAYER_NAMES[module]
                return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
        hint = f" ({self.hint})" if self.hint else ""
        raise ConfigError(f"GGUF tensor {gguf_name!r} is not part of a {self.arch} model{hint}")


def _llama_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    return {}


def _qwen3_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


def _gemma_common(k: _Keys, base: dict[str, Any], pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share. llama.cpp hard-codes the sliding pattern (every `pattern`-th
    layer global, the others local, the last of each group global) and the attention scale:
    1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 27B model (Hugging Face's
    query_pre_attn_scalar), which llama.cpp recognises by its layer count. A file may state the
    scale in `<arch>.attention.scale` (our converter does when a model is neither), and the
    layers' kinds in `<arch>.attention.sliding_window_pattern` (a period, or a flag per layer,
    true for a sliding one), as newer llama.cpp converters write for other models."""
    window = int(k.need("attention.sliding_window"))
    layers = base["num_layers"]
    stated = k.get("attention.sliding_window_pattern")
    if isinstance(stated, list):
        if len(stated) != layers:
            raise ConfigError(
                f"GGUF {k.arch}.attention.sliding_window_pattern has {len(stated)} of {layers} layers"
            )
        sliding = [bool(x) for x in stated]
    else:
        period = int(stated) if stated else pattern
        sliding = [(i + 1) % period != 0 for i in range(layers)]
    windows = tuple(window if slides else None for slides in sliding)
    big = {"gemma2": 46, "gemma3": 62}[k.arch]
    implied = base["hidden_size"] / base["num_heads"] if layers == big else base["head_dim"]
    scale = k.get("attention.scale")
    if len(set(windows)) == 1:  # one kind of layer (too few layers for a global one)
        window_fields = {"sliding_window": windows[0], "layer_sliding_windows": None}
    else:
        window_fields = {"sliding_window": None, "layer_sliding_windows": windows}
    return {
        **window_fields,
        "attn_scale": float(scale) if scale is not None else implied**-0.5,
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "hidden_act": "gelu_pytorch_tanh",
        # Gemma multiplies embeddings by sqrt(hidden); not stored, implied by the architecture.
        "embedding_multiplier": math.sqrt(base["hidden_size"]),
    }


def _gemma2_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    return {
        **_gemma_common(k, base, pattern=2),
        "attn_logit_softcap": _f32(k.need("attn_logit_softcapping")),
        "final_logit_softcap": _f32(k.need("final_logit_softcapping")),
        "tie_word_embeddings": True,  # Gemma 2 has no output.weight: the head is the embedding
    }


def _gemma3_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    caps = {
        name: _f32(v)
        for name, key in (
            ("attn_logit_softcap", "attn_logit_softcapping"),
            ("final_logit_softcap", "final_logit_softcapping"),
        )
        if (v := k.get(key))
    }
    return {
        **_gemma_common(k, base, pattern=6),
        **caps,
        "qk_norm": True,
        # llama.cpp's gemma3: the local (sliding) layers' RoPE base is 10000, not stored.
        "rope_local_theta": 10000.0,
    }


def _phi3_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    head_dim = base["head_dim"]
    rope_dim = int(k.need("rope.dimension_count"))
    out: dict[str, Any] = {"partial_rotary_factor": rope_dim / head_dim}
    window = k.get("attention.sliding_window")
    out["sliding_window"] = int(window) if window else None  # the converter writes 0 for none
    long, short = (tensors.get(n) for n in _ROPE_FACTORS)
    if (long is None) != (short is None):
        raise ConfigError("GGUF phi3 file has only one of rope_factors_long / rope_factors_short")
    if long is not None and short is not None:
        original = int(k.need("rope.scaling.original_context_length"))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": long.dequantize(torch.float32).tolist(),
            "short_factor": short.dequantize(torch.float32).tolist(),
            "original_max_position_embeddings": original,
        }
        # Hugging Face's longrope: `factor` is the context extension; the attention factor
        # follows from it unless the file states another.
        factor = int(k.need("context_length")) / original
        scaling["factor"] = factor
        implied = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        if (attn := k.get("rope.scaling.attn_factor")) is not None and not math.isclose(
            float(attn), implied, rel_tol=1e-6
        ):
            scaling["attention_factor"] = _f32(attn)
        for name in ("long_factor", "short_factor"):
            if len(scaling[name]) != rope_dim // 2:
                raise ConfigError(
                    f"GGUF rope_factors_{name[:-7]} has {len(scaling[name])} values; the rotary "
                    f"dimension {rope_dim} needs {rope_dim // 2}"
                )
        out["rope_scaling"] = scaling
    return out


def _qwen3moe_fields(k: _Keys, tensors: Mapping[str, GGUFTensor], base: dict[str, Any]) -> dict[str, Any]:
    experts, used = int(k.need("expert_count")), int(k.need("expert_used_count"))
    if not 1 <= used <= experts:
        raise ConfigError(f"GGUF {k.arch}.expert_used_count {used} outside 1..{experts}")
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (Qwen3-MoE releases set
    # norm_topk_prob); `expert_weights_norm`, where a file states it, says so explicitly.
    norm = k.get("expert_weights_norm")
    return {
        "qk_norm": True,
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(k.need("expert_feed_forward_length")),
        "norm_topk_prob": True if norm is None else bool(norm),
    }


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily(
        "llama",
        layer_tensors=(*_ATTENTION, *_DENSE_FFN),
        fields=_llama_fields,
        permuted_qk=True,
        hint="mixture-of-experts files with general.architecture llama (Mixtral) are unsupported",
    ),
    "qwen2": GGUFFamily("qwen2", layer_tensors=(*_ATTENTION, *_DENSE_FFN), fields=_llama_fields),
    "qwen3": GGUFFamily(
        "qwen3", layer_tensors=(*_ATTENTION, "attn_q_norm", "attn_k_norm", *_DENSE_FFN), fields=_qwen3_fields
    ),
    "qwen3moe": GGUFFamily(
        "qwen3moe",
        layer_tensors=(*_ATTENTION, "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", *_EXPERT_NAMES),
        fields=_qwen3moe_fields,
        experts=True,
    ),
    "gemma2": GGUFFamily(
        "gemma2",
        layer_tensors=(*_ATTENTION, *_DENSE_FFN, "post_attention_norm", "post_ffw_norm"),
        fields=_gemma2_fields,
        norm_plus_one=True,
        sandwich_norms=True,
    ),
    "gemma3": GGUFFamily(
        "gemma3",
        layer_tensors=(
            *_ATTENTION,
            "attn_q_norm",
            "attn_k_norm",
            *_DENSE_FFN,
            "post_attention_norm",
            "post_ffw_norm",
        ),
        fields=_gemma3_fields,
        norm_plus_one=True,
        sandwich_norms=True,
    ),
    "phi3": GGUFFamily(
        "phi3",
        # Converters write Hugging Face's fused qkv_proj as attn_qkv; llama.cpp also reads phi3
        # files with separate attn_q / attn_k / attn_v.
        layer_tensors=("attn_qkv", *_ATTENTION, "ffn_norm", "ffn_up", "ffn_down"),
        fields=_phi3_fields,
        fused_gate_up=True,
    ),
}


def gguf_support(arch: str) -> dict[str, Any]:
    """The `ModelArchitecture` fields that serve GGUF files of `general.architecture` `arch`:
    `ModelArchitecture(..., **gguf_support("qwen2"))`. One GGUF architecture per model
    architecture: its tensor adapter undoes that architecture's conversion edits."""
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"no GGUF reader for {arch!r}; known: {', '.join(GGUF_FAMILIES)}")
    return {
        "gguf_architectures": (arch,),
        "parse_gguf_config": parse_gguf_config,
        "gguf_tensor": GGUF_FAMILIES[arch].tensor,
    }


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


def _family(arch: Any) -> GGUFFamily:
    if arch not in GGUF_FAMILIES:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not one lmstack reads (it reads {', '.join(GGUF_FAMILIES)})"
        )
    return GGUF_FAMILIES[arch]


def parse_gguf_config(
    meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor], name: str = ""
) -> ModelConfig:
    """The ModelConfig of a GGUF file of any architecture in `GGUF_FAMILIES` (a `MoEConfig` for
    qwen3moe): the `<arch>.*` keys every family has, then the family's own."""
    arch = meta.get("general.architecture")
    family = _family(arch)
    k = _Keys(meta, str(arch))
    hidden = int(k.need("embedding_length"))
    heads = int(k.need("attention.head_count"))
    kv_heads = k.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # a per-layer list in some files
        if len(set(kv_heads)) != 1:
            raise ConfigError(f"GGUF {arch}.attention.head_count_kv differs between layers ({kv_heads})")
        kv_heads = kv_heads[0]
    head_dim = int(k.get("attention.key_length", hidden // heads))
    if int(k.get("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"GGUF {arch}.attention.value_length differs from key_length (unsupported)")
    rope_theta = _f32(k.get("rope.freq_base", 10000.0))
    rope_dim = int(k.get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and family.permuted_qk:
        raise ConfigError(
            f"GGUF {arch}.rope.dimension_count {rope_dim} is not the head size {head_dim}: partial "
            f"rotary embeddings are not implemented for {arch} files"
        )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    bias = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    fields: dict[str, Any] = dict(
        vocab_size=_vocab_size(k, meta, tensors),
        hidden_size=hidden,
        intermediate_size=int(k.get("feed_forward_length", 0)) or _required_ffn(k, family),
        num_layers=int(k.need("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(k.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=gguf_rope_scaling(meta, str(arch), tensors.get(_ROPE_FREQS), rope_theta, rope_dim),
        max_position_embeddings=int(k.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        sliding_window=int(sw) if (sw := k.get("attention.sliding_window")) else None,
        attention_bias=bias,
        # o_proj's bias follows attention_bias unless the file shows otherwise (Qwen2: q, k, v only).
        output_bias="blk.0.attn_output.bias" in tensors if bias else True,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=gguf_eos_token_ids(meta),
        name=name,
        # llama.cpp rotates the first rope.dimension_count dimensions of each head.
        partial_rotary_factor=rope_dim / head_dim,
    )
    fields.update(family.fields(k, tensors, fields))
    rotary = int(fields["head_dim"] * fields.get("partial_rotary_factor", 1.0))
    # What the decoder's RoPE would not compute exactly is one line here, not a wrong token.
    check_rope_scaling(fields["rope_scaling"], rotary, f"GGUF file of model {name!r}")
    if family.experts:
        from lmstack.model.moe import MoEConfig  # moe -> llama -> this module

        return MoEConfig(**fields)
    return ModelConfig(**fields)


def _required_ffn(k: _Keys, family: GGUFFamily) -> int:
    if family.experts:  # every qwen3moe layer is sparse: the dense width is unused
        return int(k.need("expert_feed_forward_length"))
    return int(k.need("feed_forward_length"))


def _vocab_size(k: _Keys, meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor]) -> int:
    """The embedding's rows: what the model is built with (llama.cpp pads the token list to it)."""
    if (embd := tensors.get("token_embd.weight")) is not None:
        return int(embd.shape[0])
    vocab = k.get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ConfigError("GGUF file has neither a vocabulary size nor a token_embd.weight tensor")
    return int(vocab)


def load_gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def _expert(stacked: GGUFTensor, e: int) -> GGUFTensor:
    """Expert `e` of a stacked [experts, rows, cols] tensor: its rows, still packed."""
    return GGUFTensor(data=stacked.data[e], ggml_type=stacked.ggml_type, shape=tuple(stacked.shape[1:]))


def _minus_one(tensor: GGUFTensor) -> GGUFTensor:
    """A Gemma norm weight as Hugging Face stores it (w, not 1 + w). F32, as llama.cpp keeps
    norms: fl(fl(1 + w) - 1) + 1 == fl(1 + w) exactly, so the model's (1 + w) equals the file's."""
    value = tensor.dequantize(torch.float32).numpy() - np.float32(1.0)
    return GGUFTensor(data=value, ggml_type=GGMLQuantizationType.F32, shape=tensor.shape)


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
