"""A tiny random-weight mixture-of-experts model, made by transformers itself: its own config
class (`MixtralConfig`, or `Qwen2MoeConfig` with a shared expert) and `save_pretrained`, so the
folder is what a real checkpoint of that architecture looks like, and transformers is the
oracle for our logits. The tokenizer and chat template are the tiny Llama's
(`lmstack.testing.tiny_model`). Needs `transformers` (the oracle tests' dependency, not the
core's).

    python -m lmstack.testing.tiny_moe /tmp/tiny-moe [--style qwen2_moe]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lmstack.testing.tiny_model import write_tokenizer_files

STYLES = ("mixtral", "qwen2_moe")


def write_tiny_moe(
    path: str | Path,
    *,
    style: str = "mixtral",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 4,
    top_k: int = 2,
    expert_size: int = 96,
    dense_layers: tuple[int, ...] = (),
    max_position_embeddings: int = 1024,
) -> Path:
    """Write the tiny MoE model into the folder `path` (created if missing) and return it.

    transformers' initialisation (std 0.02) would give near-uniform logits and routing, where
    an argmax hinges on rounding; every parameter is redrawn from a seeded generator at the tiny
    Llama's scales (unit-ish gain per linear, router logits spread over a few units) so greedy
    tokens and expert choices are decisive and reproducible. `style` "qwen2_moe": top-k
    probabilities not renormalised, a shared expert, and dense MLPs on `dense_layers`."""
    import transformers

    if style not in STYLES:
        raise ValueError(f"style {style!r}: expected one of {', '.join(STYLES)}")
    if dense_layers and style != "qwen2_moe":
        raise ValueError("dense_layers (layers with a dense MLP) is a qwen2_moe option")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size, bos_id, eos_id = write_tokenizer_files(folder, max_position_embeddings)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        num_experts_per_tok=top_k,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if style == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_local_experts=num_experts, intermediate_size=expert_size
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=num_experts,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=2 * expert_size,
            intermediate_size=2 * expert_size,
            norm_topk_prob=False,
            mlp_only_layers=list(dense_layers),
            use_sliding_window=False,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    randomize_weights(model, seed)
    model.save_pretrained(str(folder))
    return folder


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights at the scales a trained decoder has (norm gains around 1, linears that keep
    the residual stream's size), so a tiny model's logits are neither flat nor saturated."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                param.copy_(0.5 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:  # a linear or a stack of expert linears: [..., out, in]
                param.copy_(1.5 * param.shape[-1] ** -0.5 * noise)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tiny random-weight MoE test model.")
    parser.add_argument("path", help="folder to write (created if missing)")
    parser.add_argument("--style", choices=STYLES, default="mixtral")
    args = parser.parse_args(argv)
    print(write_tiny_moe(args.path, style=args.style))


if __name__ == "__main__":
    main()
