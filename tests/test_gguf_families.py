"""GGUF files of every family lmstack serves (`general.architecture` llama, qwen2, qwen3,
qwen3moe, gemma2, gemma3, phi3), read back into the model they came from.

Each tiny Hugging Face fixture (`lmstack.testing.tiny_families`, `tiny_gemma`: transformers' own
classes and save_pretrained) is converted by our llama.cpp-style converter
(`lmstack.testing.gguf_writer`: llama.cpp's names, metadata keys and tensor edits). The reader
must give back the folder's config and weights, and the model built from the GGUF must generate
as transformers does on the folder: greedy tokens equal and, in fp32, prompt log-probabilities
within 1e-4 (over a prompt that crosses the sliding windows and a chunked-prefill boundary). Q8_0
files are held to transformers on the folder with the same Q8_0 rounding applied to its weights.
The tokenizer and chat template come from the file: byte-level BPE ("gpt2") and SentencePiece
("llama") as llama.cpp stores them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lmstack.errors import ConfigError
from lmstack.model.architecture import default_model_registry
from lmstack.model.checkpoint import to_dense
from lmstack.model.gguf_file import read_gguf
from lmstack.model.gguf_loader import GGUF_FAMILIES, parse_gguf_config
from lmstack.model.hf_loader import iter_safetensors
from lmstack.model.source import open_model_source
from lmstack.model.tokenizer import Tokenizer
from lmstack.sampling_params import SamplingParams
from lmstack.testing.gguf_writer import write_gguf
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack

transformers = pytest.importorskip("transformers")

# Fixture family -> (GGUF architecture, config.json architecture).
FAMILIES = {
    "llama3": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# ~110 tokens: past the fixtures' 32-token windows (8 for Gemma) and Phi-3's 64-token original
# context, and over two chunks of the 64-token prefill budget below.
PROMPT = " ".join(["the cat sat on the mat, and then the other cat sat on the hat"] * 8)
MAX_NEW = 8


def _write_hf(family: str, path: Path) -> Path:
    if family.startswith("gemma"):
        from lmstack.testing.tiny_gemma import write_tiny_gemma

        # llama.cpp's gemma2 has no output tensor: its GGUF files tie the head (as Gemma does).
        return write_tiny_gemma(
            int(family[-1]), path, **({"tie_word_embeddings": True} if family == "gemma2" else {})
        )
    from lmstack.testing.tiny_families import write_tiny_family

    return write_tiny_family(family, path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each family's HF folder, written once for the module (lazily)."""
    cache: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            cache[family] = _write_hf(family, tmp_path_factory.mktemp(family) / family)
            self[family] = cache[family]
            return cache[family]

    return Lazy()


@pytest.fixture(scope="module")
def gguf_files(folders, tmp_path_factory) -> dict[str, Path]:
    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            self[family] = write_gguf(folders[family], tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
            return self[family]

    return Lazy()


def _served(family: str) -> None:
    """Skip while the model side of `family` is not implemented (its architecture registered)."""
    arch, hf_arch = FAMILIES[family]
    registry = default_model_registry()
    try:
        registry.for_hf({"architectures": [hf_arch]}, family)
    except ConfigError:
        pytest.skip(f"{hf_arch} is not implemented yet (no architecture registered for it)")
    try:
        registry.for_gguf(arch, family)
    except ConfigError:
        pytest.skip(f"no architecture registers GGUF {arch!r} yet (gguf_loader.gguf_support)")


def _comparable(config) -> dict:
    out = dataclasses.asdict(config)
    out.pop("name")
    out.pop("quantization")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_equals_the_folders(family, folders, gguf_files) -> None:
    _served(family)
    hf = _comparable(open_model_source(str(folders[family])).config)
    ours = _comparable(open_model_source(str(gguf_files[family])).config)
    for key in ("rope_scaling",):  # factors went through float32 tensors or a fit
        a, b = hf.pop(key), ours.pop(key)
        assert (a is None) == (b is None), (key, a, b)
        if a is not None:
            assert a.keys() == b.keys(), (a, b)
            for k in a:
                if isinstance(a[k], str):
                    assert b[k] == a[k]
                else:
                    np.testing.assert_allclose(
                        np.asarray(b[k], dtype=np.float64), np.asarray(a[k]), rtol=1e-6
                    )
    if hf.get("attn_scale") is not None:
        assert ours.pop("attn_scale") == pytest.approx(hf.pop("attn_scale"), rel=1e-6)
    assert ours == hf


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_weights_equal_the_folders(family, folders, gguf_files) -> None:
    """Names and tensor edits undone (Q/K interleave, Gemma's 1 + w, stacked experts): every
    weight the folder has, equal; no other. Needs only the reader, not the model."""
    arch = FAMILIES[family][0]
    file = read_gguf(gguf_files[family])
    assert file.metadata["general.architecture"] == arch
    config = parse_gguf_config(file.metadata, file.tensors, family)
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in file.tensors.items():
        adapted = GGUF_FAMILIES[arch].tensor(name, tensor, config)
        for hf_name, t in adapted if isinstance(adapted, list) else [adapted] if adapted else []:
            ours[hf_name] = to_dense(t, torch.float32)
    theirs = {name: t.float() for name, t in iter_safetensors(folders[family])}
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        # Gemma's norms went through 1 + w and back in float32: within an ulp of 1.
        atol = 1e-7 if arch.startswith("gemma") and name.endswith("norm.weight") else 0
        torch.testing.assert_close(ours[name], value, atol=atol, rtol=0, msg=name)


@functools.cache
def _transformers_reference(folder: Path, ids: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    """transformers' teacher-forced log-probabilities of ids[1:] and greedy continuation (once
    per folder: the torch and cpu-paged runs share it)."""
    ids = list(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad(), one_thread():
        logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :]
    return torch.stack([logprobs[i - 1, ids[i]] for i in range(1, len(ids))]), out.tolist()


def _attention(name: str) -> dict:
    if name == "cpu-paged":
        from lmstack.stack.plugins import default_registry

        if name not in default_registry().names("attention"):
            pytest.skip("the cpu-paged attention plugin is not installed")
        from lmstack_cpu_paged.build import load_error

        if (problem := load_error()) is not None:
            pytest.skip(f"cpu-paged cannot be built here: {problem}")
    return {"prefill": {"name": name}, "decode": {"name": name}}


def _generate(path: Path, ids: list[int], attention: str = "torch"):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    stack = tiny_stack(
        path,
        scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 64},
        attention=_attention(attention),
        # The file's weights dequantized at load, whatever quantizer is installed: the
        # reference's arithmetic.
        quant={"weights": "none"},
    )
    llm = reference_llm(stack) if attention == "torch" else LLM(stack, plugin_manager=make_plugin_manager())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    try:
        with one_thread():
            out = llm.generate(ids, params)[0]
    finally:
        if attention != "torch":
            llm.engine.shutdown()
    logprobs = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    return logprobs, out.outputs[0].token_ids


def _check_against(reference_folder: Path, gguf_path: Path, attention: str = "torch") -> None:
    ids = Tokenizer.from_hf_folder(reference_folder).encode(PROMPT)
    assert len(ids) > 100
    theirs, expected = _transformers_reference(reference_folder, tuple(ids))
    ours, tokens = _generate(gguf_path, ids, attention)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert tokens == expected
    # The comparison means something: the model's log-probabilities are far from uniform (the
    # tied llama3 fixture's greedy text repeats one token, so its check is the prompt's).
    assert theirs.std() > 0.2


@pytest.mark.parametrize("attention", ["torch", "cpu-paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_generates_as_transformers_on_the_folder(family, attention, folders, gguf_files) -> None:
    _served(family)
    _check_against(folders[family], gguf_files[family], attention)


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "gemma2"])
def test_q8_0_gguf_generates_as_transformers_on_the_rounded_folder(family, folders, tmp_path) -> None:
    """Q8_0 blocks read packed (the Q/K interleave and the expert split are row selections on
    them): the reference is the folder with every matrix Q8_0-rounded by the gguf package."""
    from safetensors.torch import save_file

    _served(family)
    path = write_gguf(folders[family], tmp_path / f"{family}.q8_0.gguf", tensor_type="q8_0")
    types = {t.ggml_type.name for t in read_gguf(path).tensors.values()}
    assert "Q8_0" in types
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    for f in folders[family].iterdir():
        if f.suffix != ".safetensors":
            (rounded / f.name).write_bytes(f.read_bytes())
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {}
    for name, t in iter_safetensors(folders[family]):
        arr = t.float().numpy()
        if arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            arr = gguf.quants.dequantize(gguf.quants.quantize(arr, q8), q8).reshape(arr.shape)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    save_file(tensors, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    _check_against(rounded, path)


def test_q8_0_experts_stay_packed_through_the_gguf_quantizer(folders, tmp_path) -> None:
    """The gguf plugin keeps each expert's Q8_0 rows (sliced out of the stacked tensor) as blocks
    and generates as the same file dequantized at load."""
    pytest.importorskip("lmstack_gguf")
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager
    from lmstack_gguf.linear import GGUFLinear

    _served("qwen3_moe")
    path = write_gguf(folders["qwen3_moe"], tmp_path / "moe.q8_0.gguf", tensor_type="q8_0")
    ids = Tokenizer.from_hf_folder(folders["qwen3_moe"]).encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    results = []
    for quant in ({"weights": "gguf", "activations": "fp32", "kv_cache": "none"}, {"weights": "none"}):
        llm = LLM(
            {**tiny_stack(path), "attention": "torch", "quant": quant}, plugin_manager=make_plugin_manager()
        )
        try:
            model = llm.engine.executor.runner.model
            packed = [m for n, m in model.named_modules() if ".experts." in n and isinstance(m, GGUFLinear)]
            assert bool(packed) == (quant["weights"] == "gguf")
            with one_thread():
                out = llm.generate(ids, params)[0]
        finally:
            llm.engine.shutdown()
        logprobs = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
        results.append((out.outputs[0].token_ids, logprobs))
    (tokens, ours), (expected, theirs) = results
    assert tokens == expected
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Tokenizers and chat templates from the file
# ---------------------------------------------------------------------------------------------

TEXTS = [
    "the cat sat on the mat",
    "  leading spaces, then\ttabs\nand newlines\n\n",
    "Numbers 12345 and punctuation!?",
    "accents: café, naïve; CJK: 日本語",
    "<|im_start|>user\nhello<|im_end|>",
]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_byte_level_tokenizer_and_chat_template_from_the_file(family, folders, gguf_files) -> None:
    theirs = Tokenizer.from_hf_folder(folders[family])
    meta = read_gguf(gguf_files[family]).metadata
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    ours = Tokenizer.from_gguf_metadata(meta)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.bos_token_id == theirs.bos_token_id


def _sentencepiece_folder(folder: Path, *, prefix_space: bool) -> Path:
    """A SentencePiece-style tokenizer.json (BPE over "▁"-spelled text, byte fallback), as
    transformers converts Llama 2 (`prefix_space`) and Gemma (none) tokenizers: every split of a
    merged piece into two pieces is a merge, ranked by the piece."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as Backend

    specials = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    chars = list("▁abcdefghijklmnopqrstuvwxyzTN,.!?0123456789")
    pieces = [
        "▁t",
        "he",
        "▁the",
        "in",
        "at",
        "▁c",
        "▁cat",
        "▁s",
        "▁sat",
        "on",
        "▁on",
        "er",
        "▁m",
        "▁mat",
        "ing",
    ]
    vocab: dict[str, int] = {}
    for tok in [*specials, *(f"<0x{b:02X}>" for b in range(256)), *chars, *pieces]:
        vocab.setdefault(tok, len(vocab))
    merges = [
        (p[:cut], p[cut:])
        for p in pieces
        for cut in range(1, len(p))
        if p[:cut] in vocab and p[cut:] in vocab
    ]
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    space = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), space]) if prefix_space else space
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials[:3]])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in specials[3:]])
    backend.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template})
    )
    return folder


@pytest.mark.parametrize("prefix_space", [True, False], ids=["llama2-style", "gemma-style"])
def test_sentencepiece_tokenizer_from_the_file(prefix_space, folders, tmp_path) -> None:
    import shutil

    from tokenizers import Tokenizer as Backend

    folder = tmp_path / "spm"
    shutil.copytree(folders["llama3"], folder)
    _sentencepiece_folder(folder, prefix_space=prefix_space)
    path = write_gguf(folder, tmp_path / "spm.gguf")
    meta = read_gguf(path).metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] == prefix_space
    ours = Tokenizer.from_gguf_metadata(meta)
    theirs = Backend.from_file(str(folder / "tokenizer.json"))
    texts = [*TEXTS, "the cat sat on the mat<start_of_turn>the mat</s>", "xyz", " the  cat "]
    for text in texts:
        expected = theirs.encode(text, add_special_tokens=True).ids
        assert ours.encode(text, add_special_tokens=True) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == theirs.decode(
            expected, skip_special_tokens=False
        )
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("日本"))  # byte fallback
    chat = [{"role": "user", "content": "the cat"}]
    assert (
        ours.apply_chat_template(chat, add_generation_prompt=False)
        == "<start_of_turn>user\nthe cat<end_of_turn>\n"
    )
    assert ours.eos_token_ids[0] == theirs.token_to_id("</s>")


# ---------------------------------------------------------------------------------------------
# One-line refusals
# ---------------------------------------------------------------------------------------------


def _bare_gguf(path: Path, arch: str, **keys) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_missing_metadata_key_is_one_line_naming_it(tmp_path) -> None:
    base = dict(embedding_length=64, block_count=1, feed_forward_length=128)
    path = _bare_gguf(tmp_path / "m.gguf", "qwen3moe", **base, **{"attention.head_count": 4})
    file = read_gguf(path)
    with pytest.raises(
        ConfigError, match=r"^GGUF metadata lacks qwen3moe.expert_count, which a qwen3moe model needs$"
    ):
        parse_gguf_config(file.metadata, file.tensors)
    path = _bare_gguf(
        tmp_path / "g.gguf", "gemma2", **base, **{"attention.head_count": 4, "attention.sliding_window": 8}
    )
    file = read_gguf(path)
    with pytest.raises(ConfigError, match=r"lacks gemma2.attn_logit_softcapping"):
        parse_gguf_config(file.metadata, file.tensors)


@pytest.mark.parametrize(
    ("stated", "expected"),
    [
        (None, (8, 8, 8, 8, 8, None, 8)),
        (3, (8, 8, None, 8, 8, None, 8)),
        ([True, False] * 3 + [True], (8, None) * 3 + (8,)),
    ],
)
def test_gemma3_sliding_layers_follow_llama_cpp_or_the_stated_pattern(tmp_path, stated, expected) -> None:
    """llama.cpp's gemma3: 5 local layers to 1 global unless the file states the pattern."""
    w = gguf.GGUFWriter(str(tmp_path / "g3.gguf"), "gemma3")
    w.add_embedding_length(64)
    w.add_block_count(7)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_sliding_window(8)
    if stated is not None:
        w.add_sliding_window_pattern(stated)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file = read_gguf(tmp_path / "g3.gguf")
    config = parse_gguf_config(file.metadata, file.tensors)
    assert tuple(config.layer_window(i) for i in range(7)) == expected
    assert (config.rope_theta, config.rope_local_theta, config.attn_scale) == (10000.0, 10000.0, 16**-0.5)


def test_an_unknown_architecture_is_one_line_listing_the_served_ones(tmp_path) -> None:
    file = read_gguf(_bare_gguf(tmp_path / "x.gguf", "mamba"))
    with pytest.raises(
        ConfigError, match=r"'mamba' is not one lmstack reads \(it reads llama, qwen2, qwen3, "
    ):
        parse_gguf_config(file.metadata, file.tensors)


def test_an_unknown_pre_tokenizer_is_refused(folders, gguf_files) -> None:
    meta = {**read_gguf(gguf_files["qwen3"]).metadata, "tokenizer.ggml.pre": "jais"}
    with pytest.raises(ConfigError, match=r"tokenizer.ggml.pre 'jais' is not supported \(supported: .*qwen2"):
        Tokenizer.from_gguf_metadata(meta)
