"""Write a Hugging Face model folder as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
lays it out (its tensor names, `<arch>.*` metadata keys and tensor edits, `tokenizer.ggml.*`),
for tests: the GGUF reader (`lmstack.model.gguf_loader`) must give back the folder's model.

Our own small converter over the gguf package's writer and name tables
(`gguf.get_tensor_name_map`); the edits it makes are llama.cpp's:
- llama: Q and K rows (weights and biases) interleaved per head for llama.cpp's pairwise RoPE;
- gemma2 / gemma3: 1 added to every RMSNorm weight (llama.cpp multiplies by the weight);
- qwen3moe: each layer's experts stacked into one [experts, rows, cols] tensor per projection;
- phi3: LongRoPE factors as `rope_factors_long/short.weight` tensors;
- llama 3.x RoPE scaling as a `rope_freqs.weight` tensor of frequency divisors.
Where llama.cpp cannot represent a model (a Gemma 3 whose local RoPE base is not 10000, say), this
raises instead of writing a file that means another model.

    python -m lmstack.testing.gguf_writer HF_FOLDER OUT.gguf [--type f32|f16|q8_0|q4_k_m|...]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# config.json model_type -> GGUF general.architecture.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
# What `tensor_type` may name: one type for every matrix, or "q4_k_m", llama.cpp's mix (below).
# K-quants and Q5_x / IQ4_NL blocks come from our reference packer (`lmstack.testing.gguf_quants`).
TYPES = (
    "f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q5_1",
    "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m", "iq4_nl",
)  # fmt: skip
# A matrix whose rows are not whole blocks of the asked type falls back as llama.cpp's quantizer
# does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; Q2_K / Q3_K -> Q4_0 here, IQ4_NL there, so a
# fixture's layers stay in a packed type), and to F16 where rows are not whole 32-blocks.
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# Q4_K_M, as llama.cpp mixes it (simplified: every layer, not half of them): Q6_K for these
# tensors, Q4_K for the other matrices.
_Q4_K_M_Q6 = re.compile(r"(\.attn_v|\.ffn_down(_exps)?|^output)\.weight$")

# llama.cpp token types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def write_gguf(folder: str | Path, out: str | Path, *, tensor_type: str = "f32") -> Path:
    """Convert the Hugging Face folder `folder` into the GGUF file `out`. `tensor_type`: what
    matrices are stored as (one of `TYPES`; a matrix whose rows are not whole blocks of it falls
    back as llama.cpp does, `_FALLBACK`); vectors (norms, biases) are always f32, and so is a
    MoE router (`ffn_gate_inp`) in the K-quant mixes, as llama.cpp keeps it."""
    import gguf
    from safetensors import safe_open

    folder, out = Path(folder), Path(out)
    if tensor_type not in TYPES:
        raise ValueError(f"tensor_type {tensor_type!r}: expected one of {', '.join(TYPES)}")
    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r}: expected one of {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    extra = _write_hparams(writer, arch, cfg)

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).float()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], int(cfg["num_hidden_layers"]))
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    out_tensors: dict[str, np.ndarray] = dict(extra)
    for name, value in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", arch.startswith("gemma")):
            continue
        arr = value.numpy()
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = arr
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name == "lm_head.weight" and arch == "gemma2":
            raise ValueError("llama.cpp's gemma2 has no output tensor: an untied head cannot be written")
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {name!r} of a {arch} model")
        if arch == "llama" and re.search(r"\.self_attn\.(q|k)_proj\.", name):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg.get("num_key_value_heads")
            arr = _interleave_rope_rows(arr, int(heads or cfg["num_attention_heads"]))
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        out_tensors[gguf_name] = arr
    for (layer, proj), by_expert in sorted(experts.items()):
        out_tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
            [by_expert[e] for e in sorted(by_expert)]
        )
    for gguf_name, arr in out_tensors.items():
        _add_tensor(writer, gguf_name, np.ascontiguousarray(arr, dtype=np.float32), tensor_type)

    _write_tokenizer(writer, folder, cfg)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: Any, name: str, arr: np.ndarray, tensor_type: str) -> None:
    import gguf

    if arr.ndim == 1 or tensor_type == "f32" or name.startswith("rope_"):
        writer.add_tensor(name, arr)
        return
    if tensor_type == "q4_k_m":
        tensor_type = "q6_k" if _Q4_K_M_Q6.search(name) else "q4_k"
    if "_k" in tensor_type and "ffn_gate_inp" in name:
        writer.add_tensor(name, arr)
        return
    kind = tensor_type
    while kind not in ("f16", "bf16") and arr.shape[-1] % gguf.GGML_QUANT_SIZES[_GGML[kind]][0]:
        kind = _FALLBACK.get(kind, "f16")
    if kind == "f16":
        writer.add_tensor(name, arr.astype(np.float16))
        return
    qtype = _GGML[kind]
    if qtype in (
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
    ):
        blocks = gguf.quants.quantize(arr, qtype)
    else:
        from lmstack.testing.gguf_quants import quantize

        blocks = quantize(arr, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)


def _ggml_types() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as T

    return {name: T[name.upper()] for name in TYPES if name not in ("f32", "q4_k_m")}


_GGML = _ggml_types()


def _interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K edit: per head, rows (0, d/2, 1, d/2 + 1, ...)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    params = dict(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get(layer_type) or {})
    merged = {**(cfg.get("rope_scaling") or {}), **params}
    if "type" in merged:
        merged.setdefault("rope_type", merged.pop("type"))
    merged.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return merged


def _write_hparams(w: Any, arch: str, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The `<arch>.*` keys; returns the tensors llama.cpp stores for RoPE (rope_freqs, LongRoPE
    factors)."""
    import gguf

    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or heads))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = _rope(cfg)
    kind = rope.get("rope_type", "default")
    w.add_rope_freq_base(float(rope["rope_theta"]))
    tensors: dict[str, np.ndarray] = {}
    if arch == "llama" and kind == "llama3":
        tensors["rope_freqs.weight"] = _llama3_divisors(rope, head_dim)
        # llama.cpp keeps only the divisors; the original context helps the reader fit them
        # when it is not one of the Llama 3.x releases'.
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "longrope"):
        raise ValueError(f"RoPE type {kind!r} has no GGUF encoding here")
    if arch == "llama" and cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError("llama.cpp's qwen2 has no sliding window; this model would change")
    if arch == "qwen3moe":
        w.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ValueError("llama.cpp's qwen3moe has experts on every layer")
        if not cfg.get("norm_topk_prob"):
            # llama.cpp's qwen3moe always renormalises; say so where the model does not.
            w.add_expert_weights_norm(False)
    if arch.startswith("gemma"):
        _gemma_hparams(w, arch, cfg, rope, head_dim, layers)
    if arch == "phi3":
        tensors |= _phi3_hparams(w, cfg, rope, head_dim)
    return tensors


def _gemma_hparams(
    w: Any, arch: str, cfg: dict[str, Any], rope: dict[str, Any], head_dim: int, layers: int
) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(int(cfg["sliding_window"]))
    pattern = 2 if arch == "gemma2" else 6
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if cfg.get("layer_types") is not None and list(cfg["layer_types"]) != expected:
        raise ValueError(f"llama.cpp's {arch} slides on all layers but every {pattern}th; not this model's")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(w, f"add_{key}")(float(cfg[key]))
        elif arch == "gemma2":
            raise ValueError(f"a gemma2 GGUF needs {key}")
    if arch == "gemma3":
        local = _rope(cfg, "sliding_attention")
        if (
            float(local.get("rope_theta", 10000.0)) != 10000.0
            or local.get("rope_type", "default") != "default"
        ):
            raise ValueError("llama.cpp's gemma3 runs its sliding layers at RoPE base 10000, unscaled")
    # llama.cpp derives the attention scale from the model size; where the model's
    # query_pre_attn_scalar gives another, it is stated (a key llama.cpp writes for other models).
    big = {"gemma2": 46, "gemma3": 62}[arch]
    implied = hidden / heads if layers == big else head_dim
    scalar = float(cfg.get("query_pre_attn_scalar", head_dim))
    if scalar != implied:
        w.add_attention_scale(scalar**-0.5)


def _phi3_hparams(w: Any, cfg: dict[str, Any], rope: dict[str, Any], head_dim: int) -> dict[str, np.ndarray]:
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rope_dim = int(factor * head_dim)
    w.add_rope_dimension_count(rope_dim)
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    longest = int(cfg["max_position_embeddings"])
    original = int(
        cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or longest
    )
    w.add_rope_scaling_orig_ctx_len(original)
    if rope.get("rope_type") != "longrope":
        return {}
    long, short = (np.asarray(rope[k], dtype=np.float32) for k in ("long_factor", "short_factor"))
    if len(long) != rope_dim // 2 or len(short) != rope_dim // 2:
        raise ValueError(f"LongRoPE factors must have {rope_dim // 2} values")
    scale = longest / original
    attn = rope.get("attention_factor")
    if attn is None:  # what llama.cpp's converter computes
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    w.add_rope_scaling_attn_factors(float(attn))
    return {"rope_factors_long.weight": long, "rope_factors_short.weight": short}


def _llama3_divisors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs: default inverse frequency / llama3-scaled one, per frequency."""
    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope["original_max_position_embeddings"])
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = np.clip((original / wavelen - low) / (high - low), 0, 1)
    return (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


# Pre-tokenizer split regexes of tokenizer.json -> llama.cpp's tokenizer.ggml.pre.
def _known_splits() -> dict[str, str]:
    from lmstack.model import tokenizer as t

    return {regex: pre for pre, regex in t._SPLIT_PRE.items()}


def _write_tokenizer(w: Any, folder: Path, cfg: dict[str, Any]) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template from tokenizer.json / tokenizer_config.json."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r}: only BPE tokenizers are written")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, t in added.items():
        vocab.setdefault(content, t["id"])
    size = max(int(cfg["vocab_size"]), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]  # llama.cpp pads to the embedding's rows
    types = [_UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = _NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    sentencepiece = bool(model.get("byte_fallback"))
    for t in added.values():
        types[t["id"]] = _CONTROL if t.get("special") else _USER_DEFINED
    if sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        unk = model.get("unk_token")
        # SentencePiece merges the pair whose result scores highest: the earlier a merge, the higher.
        scores = [0.0] * size
        for rank, merge in reversed(list(enumerate(merges))):
            scores[vocab[merge.replace(" ", "")]] = -float(rank)
        for text, i in vocab.items():
            if re.fullmatch(r"<0x[0-9A-F]{2}>", text):
                types[i] = _BYTE
            elif text == unk:
                types[i] = _UNKNOWN
        w.add_token_scores(scores)
        w.add_add_space_prefix("Prepend" in json.dumps(tok.get("normalizer")) or _metaspace_prepends(tok))
        if unk is not None:
            w.add_unk_token_id(vocab[unk])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(_pre_name(tok.get("pre_tokenizer")))
        w.add_token_merges(merges)
    w.add_token_list(tokens)
    w.add_token_types(types)

    def token_id(key: str) -> int | None:
        value = tok_cfg.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        return vocab.get(content) if isinstance(content, str) else None

    if (bos := token_id("bos_token")) is not None:
        w.add_bos_token_id(bos)
    eos = token_id("eos_token")
    if eos is None and cfg.get("eos_token_id") is not None:
        eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    if eos is not None:
        w.add_eos_token_id(int(eos))
    if (pad := token_id("pad_token")) is not None:
        w.add_pad_token_id(pad)
    post = json.dumps(tok.get("post_processor"))
    w.add_add_bos_token(bos is not None and tokens[bos] in post)
    w.add_add_eos_token(False)
    template = folder / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else tok_cfg.get("chat_template")
    if isinstance(chat, str):
        w.add_chat_template(chat)


def _metaspace_prepends(tok: dict[str, Any]) -> bool:
    pre = json.dumps(tok.get("pre_tokenizer"))
    return '"Metaspace"' in pre and '"never"' not in pre


def _pre_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's tokenizer.ggml.pre for a byte-level tokenizer.json pre-tokenizer."""
    if pre is None:
        raise ValueError("byte-level tokenizer without a pre-tokenizer")
    steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
    kinds = [s["type"] for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = steps[0]["pattern"].get("Regex")
        if regex in _known_splits():
            return _known_splits()[regex]
    raise ValueError(f"no llama.cpp pre-tokenizer name for {kinds}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--type", choices=TYPES, default="f32")
    args = parser.parse_args(argv)
    print(write_gguf(args.folder, args.out, tensor_type=args.type))


if __name__ == "__main__":
    main()
