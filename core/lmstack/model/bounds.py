"""Sane bounds on a checkpoint's architecture metadata, checked before anything is sized by it.

A config.json or a GGUF header is input like any other: a context of 2^32 positions, 10^6
layers or a head count of 0 would size RoPE tables, layer lists and divisions before a single
weight is read. `ModelSource.config` checks the raw metadata as soon as it is read
(`check_hf_config`, `check_gguf_metadata`: types, ranges, the divisions the parsers make) and
the parsed `ModelConfig` once more (`check_model_config`: what a family or a plugin's parser
derived), so a bad checkpoint is one `ModelConfigError` line at `lmstack check` and at load.

The bounds are generous (no released model comes near them); they exist to refuse nonsense,
not to judge models. The context bound only keeps the claim a number: tables are sized by the
context the stack serves (`table_positions`), never by the checkpoint's claim alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmstack.errors import ConfigError

MAX_CONTEXT = 1 << 24  # positions
MAX_LAYERS = 1024
MAX_DIM = 1 << 20  # hidden, feed-forward, head and per-head sizes; head counts
MAX_VOCAB = 1 << 22
MAX_EXPERTS = 1 << 14
# Without a configured `max_model_len`, RoPE tables cover at most this many positions (the
# longest context common checkpoints claim): 2^17 positions x 64 frequencies x cos and sin are
# 64 MiB in fp32, where a claimed 2^24 would be 8 GiB. Set `max_model_len` to serve more.
DEFAULT_MAX_POSITIONS = 1 << 17


class ModelConfigError(ConfigError):
    """A checkpoint's metadata is malformed or absurd; the message names the field."""


def table_positions(claimed: int, max_model_len: int | None) -> int:
    """Positions a RoPE table covers: the configured `max_model_len` (at most the checkpoint's
    context), else the checkpoint's context up to `DEFAULT_MAX_POSITIONS`."""
    return min(claimed, max_model_len or DEFAULT_MAX_POSITIONS)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def int_field(value: Any, field: str, where: str, lo: int, hi: int) -> int:
    """`value` when it is an integer in lo..hi (a bool is not one), else a ModelConfigError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(f"{where}: {field} must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise ModelConfigError(f"{where}: {field} = {value} is outside the sane range {lo}..{hi}")
    return value


# config.json keys the parsers read as sizes: (lowest, highest). Absent or null: the parser's
# default (or its own "lacks" error for a required key).
_HF_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_DIM),
    "intermediate_size": (1, MAX_DIM),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_DIM),
    "num_key_value_heads": (1, MAX_DIM),
    "head_dim": (1, MAX_DIM),
    "max_position_embeddings": (1, MAX_CONTEXT),
    "original_max_position_embeddings": (1, MAX_CONTEXT),
    "sliding_window": (0, 1 << 62),
    "max_window_layers": (0, 1 << 62),
    "num_experts": (1, MAX_EXPERTS),
    "num_local_experts": (1, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "moe_intermediate_size": (1, MAX_DIM),
    "shared_expert_intermediate_size": (0, MAX_DIM),
    "decoder_sparse_step": (1, MAX_LAYERS),
}


def check_hf_config(cfg: Mapping[str, Any], where: str) -> None:
    """Types and ranges of a config.json's sizes, and the divisions its parser makes."""
    for key, (lo, hi) in _HF_BOUNDS.items():
        value = cfg.get(key)
        if value is None or (key == "sliding_window" and value is False):
            continue
        int_field(value, key, where, lo, hi)
    _check_heads(
        where,
        cfg.get("hidden_size"),
        cfg.get("num_attention_heads"),
        cfg.get("num_key_value_heads"),
        cfg.get("head_dim"),
        ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"),
    )


# GGUF `<arch>.<suffix>` keys the parsers read as sizes.
_GGUF_BOUNDS: dict[str, tuple[int, int]] = {
    "context_length": (1, MAX_CONTEXT),
    "block_count": (1, MAX_LAYERS),
    "embedding_length": (1, MAX_DIM),
    "feed_forward_length": (0, MAX_DIM),  # 0 in MoE files
    "attention.head_count": (1, MAX_DIM),
    "attention.key_length": (1, MAX_DIM),
    "attention.value_length": (1, MAX_DIM),
    "rope.dimension_count": (1, MAX_DIM),
    "rope.scaling.original_context_length": (1, MAX_CONTEXT),
    "attention.sliding_window": (0, 1 << 62),
    "vocab_size": (1, MAX_VOCAB),
    "expert_count": (1, MAX_EXPERTS),
    "expert_used_count": (1, MAX_EXPERTS),
    "expert_feed_forward_length": (1, MAX_DIM),
}


def check_gguf_metadata(meta: Mapping[str, Any], tensors: Mapping[str, Any], where: str) -> None:
    """Types and ranges of a GGUF file's `<arch>.*` sizes, and that they agree with its tensor
    index (the layers stored, the embedding's width): a header claiming 10^6 layers or a
    hidden size its embedding does not have is refused before a model is built from it."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return  # the architecture lookup reports it
    for suffix, (lo, hi) in _GGUF_BOUNDS.items():
        value = meta.get(f"{arch}.{suffix}")
        if value is not None:
            int_field(value, f"{arch}.{suffix}", where, lo, hi)
    kv_key = f"{arch}.attention.head_count_kv"
    kv = meta.get(kv_key)
    if isinstance(kv, list):  # per layer in some files
        for value in kv:
            int_field(value, kv_key, where, 1, MAX_DIM)
        kv = kv[0] if kv else None
    elif kv is not None:
        int_field(kv, kv_key, where, 1, MAX_DIM)
    hidden = meta.get(f"{arch}.embedding_length")
    _check_heads(
        where,
        hidden,
        meta.get(f"{arch}.attention.head_count"),
        kv,
        meta.get(f"{arch}.attention.key_length"),
        (f"{arch}.embedding_length", f"{arch}.attention.head_count", kv_key, f"{arch}.attention.key_length"),
    )
    layers = meta.get(f"{arch}.block_count")
    stored = {
        int(p[1]) for p in (n.split(".") for n in tensors) if p[0] == "blk" and p[1:2] and p[1].isdigit()
    }
    if layers is not None and stored and max(stored) + 1 != layers:
        raise ModelConfigError(
            f"{where}: {arch}.block_count = {layers}, but the file stores tensors for {max(stored) + 1} layers"
        )
    embd = tensors.get("token_embd.weight")
    shape = getattr(embd, "shape", None)
    if hidden is not None and shape is not None and len(shape) == 2 and shape[1] != hidden:
        raise ModelConfigError(
            f"{where}: {arch}.embedding_length = {hidden}, but token_embd.weight is {shape[1]} wide"
        )


def _check_heads(
    where: str, hidden: Any, heads: Any, kv_heads: Any, head_dim: Any, names: tuple[str, str, str, str]
) -> None:
    """Heads split the hidden size when no head size is stated; KV heads split the heads."""
    if heads is None:
        return
    if head_dim is None and hidden is not None and hidden % heads:
        raise ModelConfigError(
            f"{where}: {names[0]} = {hidden} is not a multiple of {names[1]} = {heads} (and no {names[3]} "
            "is stated)"
        )
    if kv_heads is not None and heads % kv_heads:
        raise ModelConfigError(f"{where}: {names[1]} = {heads} is not a multiple of {names[2]} = {kv_heads}")


# ModelConfig fields that are sizes (MoEConfig's too, where present).
_CONFIG_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_DIM),
    "intermediate_size": (0, MAX_DIM),  # 0: every layer's feed-forward block is experts
    "num_layers": (1, MAX_LAYERS),
    "num_heads": (1, MAX_DIM),
    "num_kv_heads": (1, MAX_DIM),
    "head_dim": (1, MAX_DIM),
    "max_position_embeddings": (1, MAX_CONTEXT),
    "num_experts": (1, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "moe_intermediate_size": (0, MAX_DIM),
}


def check_model_config(config: Any, where: str) -> None:
    """The parsed config's sizes (whatever parser made it, a plugin's included)."""
    for name, (lo, hi) in _CONFIG_BOUNDS.items():
        if hasattr(config, name):  # the MoE fields only on a MoEConfig
            int_field(getattr(config, name), f"model config {name}", where, lo, hi)
    if config.num_heads % config.num_kv_heads:
        raise ModelConfigError(
            f"{where}: {config.num_heads} attention heads are not a multiple of {config.num_kv_heads} KV heads"
        )
    if config.q_size > MAX_DIM:
        raise ModelConfigError(
            f"{where}: {config.num_heads} heads of {config.head_dim} ({config.q_size}) exceed {MAX_DIM}"
        )
