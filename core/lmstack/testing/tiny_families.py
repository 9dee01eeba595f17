"""Tiny random-weight models of each decoder family, written by transformers itself: its own
config class, model class and `save_pretrained`, so a folder is laid out as a real checkpoint of
that architecture (Phi-3's fused qkv / gate_up tensors, Qwen's biases and q/k norms, experts one
tensor each) and transformers is the oracle for our logits. The tokenizer and chat template are
the tiny Llama's (`lmstack.testing.tiny_model`). Needs `transformers` (the oracle tests'
dependency, not the core's).

Sizes: hidden 256 and MLP widths that are multiples of 256 (a GGUF K-quant block is 256 values
of a row), head_dim 64 (a whole number of AVX-512 registers in cpu-paged's fast path; Phi-3
rotates half of it; Qwen3's is 128, so its attention is wider than the hidden size), 4 query and
2 KV heads, 2 layers. Each family also exercises its variant:
Llama 3 the `llama3` RoPE scaling with tied embeddings, Mistral and Phi-3 a 32-token sliding
window, Phi-3 LongRoPE (original context 64) and a partial rotary factor, Qwen3-MoE 4 experts
with top-2 routing.

    python -m lmstack.testing.tiny_families qwen3 /tmp/tiny-qwen3
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lmstack.testing.tiny_model import write_tokenizer_files
from lmstack.testing.tiny_moe import randomize_weights

FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3")

# The sliding window of the families that have one, and Phi-3's original (pre-LongRoPE) context:
# tests cross both with prompts of ~100 tokens.
WINDOW = 32
PHI3_ORIGINAL_CONTEXT = 64


def _family(family: str, common: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, config arguments) of `family`."""
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    if family == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so that the 64-dim heads have frequencies in all three llama3 bands.
            "original_max_position_embeddings": 256,
        }
        return (
            "LlamaConfig",
            "LlamaForCausalLM",
            {**common, "rope_parameters": rope, "tie_word_embeddings": True},
        )
    if family == "mistral":
        return (
            "MistralConfig",
            "MistralForCausalLM",
            {**common, "sliding_window": WINDOW, "head_dim": head_dim},
        )
    if family == "qwen2":
        return "Qwen2Config", "Qwen2ForCausalLM", {**common, "use_sliding_window": False}
    if family == "qwen3":
        # Wider heads than hidden / heads, as Qwen3's (0.6B: 16 x 128 over a hidden of 1024): the
        # attention's width (512) is not the hidden size.
        return "Qwen3Config", "Qwen3ForCausalLM", {**common, "head_dim": 128, "use_sliding_window": False}
    if family == "qwen3_moe":
        moe = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        return (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {**common, **moe, "head_dim": head_dim, "use_sliding_window": False},
        )
    if family == "phi3":
        rotary = head_dim // 2
        gen = torch.Generator().manual_seed(1)
        # LongRoPE rescales each frequency by its own factor (>= 1), short and long lists apart.
        short = (1.0 + torch.rand(rotary // 2, generator=gen)).tolist()
        long = (1.0 + 4.0 * torch.rand(rotary // 2, generator=gen)).tolist()
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": short,
            "long_factor": long,
            "factor": common["max_position_embeddings"] / PHI3_ORIGINAL_CONTEXT,
        }
        return (
            "Phi3Config",
            "Phi3ForCausalLM",
            {
                **common,
                "rope_parameters": rope,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
                "sliding_window": WINDOW,
                "pad_token_id": 0,
            },
        )
    raise ValueError(f"unknown family {family!r}: expected one of {', '.join(FAMILIES)}")


def write_tiny_family(family: str, path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny `family` model into the folder `path` (created if missing) and return it.
    `overrides` replace config arguments (say `tie_word_embeddings=False`, or Qwen2's
    `use_sliding_window=True, sliding_window=32, max_window_layers=1`).

    transformers' initialisation (std 0.02) would give near-uniform logits, where an argmax
    hinges on rounding; every parameter is redrawn from a seeded generator at the tiny Llama's
    scales (a linear's gain ~1.5, embeddings and head spread over a few nats) so greedy tokens
    and expert choices are decisive and reproducible."""
    import transformers

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    max_positions = 1024
    vocab_size, bos_id, eos_id = write_tokenizer_files(folder, max_positions)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    config_class, model_class, kwargs = _family(family, common)
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    model = getattr(transformers, model_class)(config)
    randomize_weights(model, seed)
    model.save_pretrained(str(folder))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight model of a decoder family.")
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("path", help="folder to write (created if missing)")
    args = parser.parse_args(argv)
    print(write_tiny_family(args.family, args.path))


if __name__ == "__main__":
    main()
