"""Tiny random-weight Gemma 2 and Gemma 3 (text) models, made by transformers itself: its own
config classes (`Gemma2Config`, `Gemma3TextConfig`) and `save_pretrained`, so the folder is what
a real checkpoint of that architecture looks like, and transformers is the oracle for our
logits. The tokenizer and chat template are the tiny Llama's (`lmstack.testing.tiny_model`).
Needs `transformers` (the oracle tests' dependency, not the core's).

    python -m lmstack.testing.tiny_gemma /tmp/tiny-gemma2 --version 2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lmstack.testing.tiny_model import write_tokenizer_files

VERSIONS = (2, 3)

# Small enough for seconds-long tests, shaped to exercise every switch: head_dim (32) x heads
# (4) differs from hidden (64), so the q/o projections are not square; query_pre_attn_scalar
# differs from head_dim, so a wrong softmax scale shows; a window of 8 tokens is crossed by any
# test prompt; Gemma 2's caps are small enough to bend the random model's scores and logits
# (the published 50 and 30 would hardly touch them). The head is untied (Gemma ties it): a tied
# random Gemma repeats its last token (the embedding, scaled by sqrt(hidden), dominates what the
# tied head reads), which would leave greedy comparisons little to check; pass
# `tie_word_embeddings=True` for the tied layout.
DEFAULTS: dict[str, Any] = dict(
    tie_word_embeddings=False,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=20,
    sliding_window=8,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
VERSION_DEFAULTS: dict[int, dict[str, Any]] = {
    2: dict(num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=8.0),
    # 6 layers: five local and one global, as the published models repeat them.
    3: dict(num_hidden_layers=6, rope_local_base_freq=10000.0, rope_theta=1000000.0),
}


def write_tiny_gemma(version: int, path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny Gemma `version` (2 or 3) into the folder `path` (created if missing) and
    return it. `overrides` are config fields of `Gemma2Config` / `Gemma3TextConfig` over the
    tiny defaults above (e.g. `layer_types=[...]`, `rope_scaling={...}`, `attn_logit_softcapping=None`).

    transformers' initialisation (std 0.02) would give near-uniform logits, where an argmax hinges
    on rounding; every parameter is redrawn from a seeded generator at the tiny Llama's scales
    (unit-ish gain per linear) so greedy tokens are decisive and reproducible. Gemma's norms
    multiply by (1 + weight): their stored weights are drawn around 0."""
    import transformers

    if version not in VERSIONS:
        raise ValueError(f"Gemma version {version!r}: expected one of {VERSIONS}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    fields = {**DEFAULTS, **VERSION_DEFAULTS[version], **overrides}
    vocab_size, bos_id, eos_id = write_tokenizer_files(folder, fields["max_position_embeddings"])
    fields.update(vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=0)
    if version == 2:
        config = transformers.Gemma2Config(**fields)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(**fields)
        model = transformers.Gemma3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(0.1 * noise)  # (1 + w): gains around 1
            elif "embed_tokens" in name:
                # Scaled up by sqrt(hidden) = 8 in the model: 0.5 at the first layer, as the tiny
                # Llama's embeddings are (and, tied, logits of a unit-ish spread).
                param.copy_(0.5 / fields["hidden_size"] ** 0.5 * noise)
            else:  # a linear: [out, in]
                param.copy_(1.5 * param.shape[-1] ** -0.5 * noise)
    model.save_pretrained(str(folder))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight Gemma test model.")
    parser.add_argument("path", help="folder to write (created if missing)")
    parser.add_argument("--version", type=int, choices=VERSIONS, default=2)
    args = parser.parse_args(argv)
    print(write_tiny_gemma(args.version, args.path))


if __name__ == "__main__":
    main()
