"""A tiny random-weight Llama as a self-contained Hugging Face folder, written in milliseconds
with no download: for end-to-end tests of plugins (a quantizer, a speculator, a parallel
layout) through the real engine.

The folder holds config.json (`LlamaForCausalLM`, GQA), model.safetensors (seeded random
weights), tokenizer.json (a byte-level BPE: the 256 byte symbols, a few English merges and the
ChatML special tokens), tokenizer_config.json (a ChatML chat template) and
generation_config.json. transformers loads it as well as lmstack does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Byte-level spellings ("Ġ" is the space byte): enough merges that ordinary text becomes fewer
# tokens than bytes, so a multi-byte token path is exercised; the rest stays single bytes.
_MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "c"),
    ("o", "r"),
    ("Ġ", "w"),
    ("in", "g"),
    ("Ġ", "o"),
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer():
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from lmstack.model.tokenizer import bytes_to_unicode

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=list(_MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return backend


def write_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write the tiny Llama into the folder `path` (created if missing) and return it.

    The same arguments give the same bytes. Weights are scaled so that greedy decoding is
    deterministic but not degenerate: the logits spread over several nats (an argmax does not
    hinge on rounding), and the chosen token changes from step to step."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size, bos_id, eos_id = write_tokenizer_files(folder, max_position_embeddings)
    head_dim = hidden_size // num_heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # 1.5x unit gain: each layer moves the residual stream away from the token's own
        # embedding (at unit gain greedy text fell into one- or two-token loops within a few
        # steps; at 2x it never repeated, so a prompt-lookup drafter had nothing to propose).
        return rand(out_features, in_features, std=1.5 * in_features**-0.5)

    h, kv = hidden_size, num_kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": rand(vocab_size, h, std=0.5), "model.norm.weight": torch.ones(h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1.0 + rand(h, std=0.1),
            p + "post_attention_layernorm.weight": 1.0 + rand(h, std=0.1),
            p + "self_attn.q_proj.weight": linear(num_heads * head_dim, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, num_heads * head_dim),
            p + "mlp.gate_proj.weight": linear(intermediate_size, h),
            p + "mlp.up_proj.weight": linear(intermediate_size, h),
            p + "mlp.down_proj.weight": linear(h, intermediate_size),
        }
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = rand(vocab_size, h, std=0.5)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": h,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    return folder


def write_tokenizer_files(folder: Path, max_position_embeddings: int) -> tuple[int, int, int]:
    """The tiny byte-level tokenizer and its ChatML template into `folder` (tokenizer.json,
    tokenizer_config.json), for any tiny test model; returns (vocab size, bos id, eos id)."""
    backend = _tokenizer()
    backend.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    eos_id, bos_id = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|im_start|>")
    return backend.get_vocab_size(with_added_tokens=True), bos_id, eos_id


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
