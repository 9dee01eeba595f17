"""The folder `lmstack quantize` writes: config.json, model.safetensors (the decoder linears
encoded by the format), the tokenizer with its chat template, generation_config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lmstack.errors import ConfigError
from lmstack.model.config import ModelConfig
from lmstack.quant.formats import WeightFormat
from lmstack_calibrate.model import DenseModel


def hf_config(source: Any) -> dict[str, Any]:
    """config.json for the dense model: the folder's own for a Hugging Face source, rebuilt from
    the metadata for a GGUF file."""
    if source.format == "hf":
        cfg = dict(json.loads((source.path / "config.json").read_text(encoding="utf-8")))
        cfg.pop("quantization_config", None)
        return cfg
    c: ModelConfig = source.config
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
    }
    return cfg


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def write_tokenizer(source: Any, out: Path) -> None:
    """The tokenizer, chat template and generation config: copied from a Hugging Face folder;
    for a GGUF file, tokenizer.json from the tokenizer lmstack built from its metadata."""
    if source.format == "hf":
        for name in _TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, out / name)
        return
    tok, c = source.tokenizer, source.config
    tok.backend.save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c.max_position_embeddings,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    tok_config |= {k: v for k, v in tok.template_tokens.items()}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    write_json(out / "tokenizer_config.json", tok_config)
    gen: dict[str, Any] = {"bos_token_id": c.bos_token_id}
    if c.eos_token_ids:
        gen["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    write_json(out / "generation_config.json", gen)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def encode_model(model: DenseModel, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors: the decoder linears through `fmt.encode`
    (under `<module>.<suffix>`), everything else dense fp32."""
    linears = set(model.all_linear_names())
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.weights.items():
        if name in linears:
            module = name.removesuffix(".weight")
            for suffix, t in fmt.encode(module, tensor).items():
                tensors[f"{module}.{suffix}"] = t.contiguous()
        else:
            tensors[name] = tensor.contiguous()
    return tensors


def prepare_out_dir(out: str | Path) -> Path:
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--out {path} exists and is not an empty folder; pick a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path
