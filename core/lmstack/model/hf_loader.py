"""Read a Hugging Face model folder: config.json, *.safetensors (maybe sharded), tokenizer files;
and the config.json parsers of the decoder families (Llama, Mistral, Qwen2, Qwen3, Phi-3: one
`parse_decoder_config` and a few switches each).

Weights keep their Hugging Face names and their stored dtype: `iter_safetensors` yields them one
at a time, and only a weight loader converts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmstack.errors import ConfigError
from lmstack.model.config import ModelConfig
from lmstack.model.rope import check_rope_scaling
from lmstack.model.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def generation_overrides(folder: Path) -> dict[str, Any]:
    """bos / eos token ids from generation_config.json, when it has them: it is what HF
    generate() stops on, so it wins over config.json. Same for every architecture."""
    path = folder / "generation_config.json"
    gen = read_json(path) if path.is_file() else {}
    out: dict[str, Any] = {}
    if gen.get("eos_token_id") is not None:
        out["eos_token_ids"] = _ids(gen["eos_token_id"])
    if gen.get("bos_token_id") is not None:
        out["bos_token_id"] = int(gen["bos_token_id"])
    return out


# Activations of the gated feed-forward block the decoder implements (`layer_ops.GATED_ACTIVATIONS`).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def parse_decoder_config(cfg: Mapping[str, Any], name: str = "", **switches: Any) -> ModelConfig:
    """The fields every family of the one decoder (`lmstack.model.llama`) reads alike from a
    config.json, then the family's `switches` (ModelConfig fields) over them, then the checks
    that refuse, in one line, what the decoder would not compute exactly (an activation or RoPE
    variant it lacks). A family parser reads its own keys and passes them as switches."""
    hidden, heads = int(_need(cfg, "hidden_size", name)), int(_need(cfg, "num_attention_heads", name))
    rope_theta, rope_scaling = hf_rope(cfg)
    eos, bos = cfg.get("eos_token_id"), cfg.get("bos_token_id")
    fields: dict[str, Any] = dict(
        vocab_size=int(_need(cfg, "vocab_size", name)),
        hidden_size=hidden,
        intermediate_size=int(_need(cfg, "intermediate_size", name)),
        num_layers=int(_need(cfg, "num_hidden_layers", name)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act") or "silu"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_ids(eos),
        name=name,
    )
    config = ModelConfig(**{**fields, **switches})
    check_decoder_config(config)
    return config


def check_decoder_config(config: ModelConfig) -> None:
    """ConfigError for a parsed config the decoder would not compute exactly."""
    where = f"config.json of model {config.name!r}"
    if config.hidden_act not in ACTIVATIONS:
        raise ConfigError(
            f"{where}: activation {config.hidden_act!r} is not implemented (implemented: {', '.join(ACTIVATIONS)})"
        )
    rotary = config.rotary_dim
    if not 0 < rotary <= config.head_dim or rotary % 2:
        raise ConfigError(
            f"{where}: partial_rotary_factor {config.partial_rotary_factor} rotates {rotary} of "
            f"{config.head_dim} head dimensions; it must be an even number above 0"
        )
    check_rope_scaling(config.rope_scaling, rotary, where)
    windows = config.layer_sliding_windows
    if windows is not None and len(windows) != config.num_layers:
        raise ConfigError(f"{where}: {len(windows)} layer windows for {config.num_layers} layers")


def parse_llama_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Llama 2 / 3.x and Mistral: the decoder's defaults (a `sliding_window`, when there is one,
    on every layer)."""
    return parse_decoder_config(cfg, name)


def parse_qwen2_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Qwen2 / Qwen2.5: q, k and v have biases (o_proj and the MLP none) whatever the config
    says, as in transformers; sliding windows per layer (`layer_windows`)."""
    return parse_decoder_config(
        cfg, name, attention_bias=True, output_bias=False, mlp_bias=False, **layer_windows(cfg, name)
    )


def parse_qwen3_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Qwen3: a per-head RMSNorm of q and k before RoPE; `attention_bias` on all four
    projections, as the config says (the MLP has none); sliding windows per layer
    (`layer_windows`)."""
    return parse_decoder_config(cfg, name, qk_norm=True, mlp_bias=False, **layer_windows(cfg, name))


def parse_phi3_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up tensors (the weight mapping splits
    them), LongRoPE, a partial rotary factor (Phi-4-mini), a `sliding_window` on every layer.
    No biases: transformers' Phi3 has none whatever the config says."""
    return parse_decoder_config(
        cfg,
        name,
        attention_bias=False,
        mlp_bias=False,
        partial_rotary_factor=hf_partial_rotary_factor(cfg),
    )


def layer_windows(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """`sliding_window` / `layer_sliding_windows` switches of a family whose layers choose full
    or sliding attention by `layer_types` (Qwen2 / Qwen3, Gemma), as transformers reads them:
    `layer_types` when the config lists them, else Qwen2's rule (layers from
    `max_window_layers` on slide, when `use_sliding_window` is on). The window is None when
    `use_sliding_window` is off."""
    num_layers = int(_need(cfg, "num_hidden_layers", name))
    window = _sliding_window(cfg)
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28)) if "use_sliding_window" in cfg else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"config.json of model {name!r}: layer type {unknown[0]!r} is not implemented")
    if len(types) != num_layers:
        raise ConfigError(
            f"config.json of model {name!r}: layer_types lists {len(types)} layers, not {num_layers}"
        )
    per_layer = tuple(window if t == "sliding_attention" else None for t in types)
    if len(set(per_layer)) == 1:  # one window (or none) for every layer
        return {"sliding_window": per_layer[0], "layer_sliding_windows": None}
    return {"sliding_window": None, "layer_sliding_windows": per_layer}


def _need(cfg: Mapping[str, Any], key: str, name: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"config.json of model {name!r} lacks {key!r}")
    return cfg[key]


def _rope_dict(cfg: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The old `rope_scaling` and transformers 5's `rope_parameters` merged; for a config whose
    `rope_parameters` is per layer type (Gemma 3), that type's ("full_attention" by default)."""
    params = cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, Mapping) or v is None for v in params.values()):
        params = params.get(layer_type or "full_attention") or {}
    return {**(cfg.get("rope_scaling") or {}), **params}


def hf_rope(cfg: Mapping[str, Any], layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the old layout (`rope_theta` + `rope_scaling` with
    `type` or `rope_type`) or transformers 5's `rope_parameters` (theta inside, maybe per layer
    type: `layer_type`). What transformers takes from the config's top level is filled in as it
    does: `original_max_position_embeddings` (a top-level one wins: Phi-3), and a longrope or
    yarn `factor` from the context extension ratio."""
    merged = _rope_dict(cfg, layer_type)
    theta = float(merged.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    merged.pop("partial_rotary_factor", None)  # `hf_partial_rotary_factor`
    if "type" in merged:
        merged.setdefault("rope_type", merged.pop("type"))
    kind = merged.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind in ("su", "yarn") and cfg.get("model_type") == "phi3":  # Phi-3's old names (transformers)
        kind = merged["rope_type"] = "longrope"
    if kind == "dynamic" and "max_position_embeddings" in cfg:
        # transformers scales only past the configured maximum, whatever the dict says.
        merged["original_max_position_embeddings"] = int(cfg["max_position_embeddings"])
    if kind in ("llama3", "yarn", "longrope"):
        top = cfg.get("original_max_position_embeddings")
        if top is not None:
            merged["original_max_position_embeddings"] = int(top)
        elif "max_position_embeddings" in cfg:
            merged.setdefault("original_max_position_embeddings", int(cfg["max_position_embeddings"]))
    if kind in ("longrope", "yarn") and merged.get("factor") is None and "max_position_embeddings" in cfg:
        if merged.get("original_max_position_embeddings"):
            merged["factor"] = (
                int(cfg["max_position_embeddings"]) / merged["original_max_position_embeddings"]
            )
    return theta, merged


def hf_partial_rotary_factor(cfg: Mapping[str, Any]) -> float:
    """The rotated fraction of each head: top level (old configs) or in `rope_parameters`."""
    value = _rope_dict(cfg, None).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(value) if value is not None else 1.0


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    # Qwen2-style configs carry a window but switch it off with use_sliding_window: false.
    if cfg.get("use_sliding_window") is False:
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(v) for v in values))


def load_hf_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    return Tokenizer.from_hf_folder(
        folder, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by the index, or every *.safetensors file in the folder."""
    index = folder / _INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ConfigError(
            f"model folder {folder} has no safetensors weights" + (f" ({missing[0]})" if missing else "")
        )
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, one at a time, in its stored dtype (bf16 stays bf16)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
