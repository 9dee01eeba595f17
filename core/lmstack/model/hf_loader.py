"""Read a Hugging Face model folder: config.json, *.safetensors (maybe sharded), tokenizer files;
and the Llama architecture's config.json parser.

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


def parse_llama_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """The Llama architecture's config.json parser."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ConfigError(f"config.json of model {name!r} lacks {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope_theta, rope_scaling = hf_rope(cfg)
    eos, bos = cfg.get("eos_token_id"), cfg.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
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
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_ids(eos),
        name=name,
    )


def hf_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the old layout (`rope_theta` + `rope_scaling` with
    `type` or `rope_type`) or transformers 5's `rope_parameters` (theta inside)."""
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in merged:
        merged.setdefault("rope_type", merged.pop("type"))
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged


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
