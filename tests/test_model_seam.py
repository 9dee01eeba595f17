"""The model and weight-loading seam: architectures registered through `lmstack_register_models`,
weight loaders that receive checkpoint tensors as stored, and the checkpoint's quantization
description.

Proofs: a model architecture only a test plugin knows generates through the engine and matches
transformers; a test quantizer receives SmolLM2's Q4_1 tensors still packed and, dequantizing on
the fly, gives the normal path's logits; a bf16 safetensors folder loads bit-identically with no
fp32 tensor made on the way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lmstack import SamplingParams
from lmstack.components.none_quantizer import NoQuantizer
from lmstack.engine.llm_engine import LLMEngine
from lmstack.errors import ConfigError, ResolutionError
from lmstack.exec.model_runner import ModelRunner
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import LinearSpec, Quantizer
from lmstack.model.architecture import ModelArchitecture, ModelRegistry, build_model_registry
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_loader import unpermute_rope_index, unpermute_rope_rows
from lmstack.model.llama import ARCHITECTURE as LLAMA
from lmstack.model.llama import LlamaModel, llama_checkpoint_name
from lmstack.model.source import ModelSource, open_model_source
from lmstack.model.weight_loader import ShardId, load_named_weights, set_weight_loader
from lmstack.registry import Component
from lmstack.stack.plugins import make_plugin_manager


class DenseCausalAttention:
    """One sequence, no KV cache: plain causal attention, the reference the paged path must equal."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())[0]


def _generate(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = out.token_ids
    return tokens


def _runner(source: ModelSource, dtype: torch.dtype, quantizer: Quantizer | None = None) -> ModelRunner:
    return ModelRunner(
        source.config,
        source.architecture,
        source.weights(),
        dtype=dtype,
        device=torch.device("cpu"),
        quantizer=quantizer or NoQuantizer(),
        prefill=None,  # type: ignore[arg-type]  # these tests run the model with DenseCausalAttention
        decode=None,  # type: ignore[arg-type]
        kv_cache_dtype=dtype,
        max_positions=256,
    )


# --------------------------------------------------------------------------------------------------
# Packed GGUF tensors


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> ModelSource:
    return open_model_source("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ["blk.3.attn_q.weight", "blk.3.attn_k.weight"])
def test_unpermuting_packed_rows_equals_unpermuting_dequantized(smollm2: ModelSource, name: str) -> None:
    tensor = smollm2._gguf_tensors[name]
    assert tensor.ggml_type.name == "Q4_1" and tensor.is_quantized
    heads = smollm2.config.num_heads if "attn_q" in name else smollm2.config.num_kv_heads
    packed = tensor.take_rows(unpermute_rope_index(tensor.shape[0], heads))
    assert packed.ggml_type == tensor.ggml_type and packed.shape == tensor.shape
    assert not torch.equal(packed.raw(), tensor.raw())  # the rows really moved
    assert torch.equal(
        packed.dequantize(torch.float32), unpermute_rope_rows(tensor.dequantize(torch.float32), heads)
    )


def test_gguf_tensor_rows_and_raw_bytes(smollm2: ModelSource) -> None:
    embd = smollm2._gguf_tensors["token_embd.weight"]
    assert (embd.ggml_type.name, embd.shape, embd.block_size) == ("Q8_0", (49152, 576), (32, 34))
    raw = embd.raw()
    assert raw.dtype == torch.uint8 and raw.shape == (49152, 576 // 32 * 34)
    rows = embd.take_rows(slice(100, 103))
    assert torch.equal(rows.dequantize(torch.float32), embd.dequantize(torch.float32)[100:103])
    norm = smollm2._gguf_tensors["output_norm.weight"]
    assert not norm.is_quantized and norm.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_gguf_config_describes_tensor_types(smollm2: ModelSource) -> None:
    c = smollm2.config
    assert c.quantization == {"format": "gguf", "tensor_types": {"Q8_0": 1, "F32": 61, "Q4_1": 210}}
    assert hash(c) == hash(ModelConfig(**{**c.__dict__, "quantization": None}))  # dicts stay out of the hash
    assert smollm2.architecture is LLAMA


class PackedGGUFLinear(nn.Module):
    """Keeps each checkpoint part as the GGUF file packs it; dequantizes in forward."""

    def __init__(self, spec: LinearSpec, log: dict) -> None:
        super().__init__()
        self.spec = spec
        self.parts: dict[ShardId, GGUFTensor] = {}
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_loader(self.weight, self._load, num_shards=len(spec.output_sizes))
        self.log = log
        assert not spec.bias  # SmolLM2 has none

    def _load(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId | None) -> None:
        assert isinstance(loaded, GGUFTensor), f"{self.spec.name} got a {type(loaded).__name__}"
        shard = 0 if shard_id is None else shard_id
        self.parts[shard] = loaded
        self.log[(self.spec.name, shard)] = (loaded.ggml_type.name, loaded.shape, loaded.raw())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.cat([self.parts[i].dequantize(x.dtype) for i in range(len(self.spec.output_sizes))])
        return F.linear(x, w)


class PackedGGUFQuantizer(Quantizer):
    def __init__(self) -> None:
        self.specs: dict[str, LinearSpec] = {}
        self.log: dict = {}

    def linear_factory(self):
        def make(spec: LinearSpec) -> nn.Module:
            self.specs[spec.name] = spec
            return PackedGGUFLinear(spec, self.log if spec.name.startswith("layers.0.") else {})

        return make


class PackedPlugin:
    def __init__(self) -> None:
        self.quantizer = PackedGGUFQuantizer()

    @hookimpl
    def lmstack_register_quantizers(self, register):
        register(Component(name="gguf-packed", kind="quantizer", factory=lambda o, c: self.quantizer))


def test_quantizer_receives_gguf_tensors_packed_and_matches_the_dense_path(smollm2: ModelSource) -> None:
    plugin = PackedPlugin()
    engine = LLMEngine(
        {
            "model": "smollm2-135m-instruct",
            "dtype": "float32",
            "quant": {"weights": "gguf-packed"},
            "allocator": {"num_blocks": 32},
        },
        plugin_manager=make_plugin_manager(autoload=False, extra_plugins=[plugin]),
    )
    q = plugin.quantizer
    c = smollm2.config
    # The specs the model asked for: fused parts and the split each layer wants under TP.
    qkv, o, gate_up, down = (
        q.specs[f"layers.0.{n}"] for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    assert (qkv.output_sizes, qkv.parallel, qkv.in_features) == ((576, 192, 192), "column", 576)
    assert (gate_up.output_sizes, gate_up.parallel) == ((1536, 1536), "column")
    assert (o.parallel, down.parallel, down.in_features) == ("row", "row", 1536)
    assert len(q.specs) == 4 * c.num_layers

    # Layer 0's parts arrived packed, byte for byte what the file holds (Q / K rows unpermuted).
    file = smollm2._gguf_tensors
    v_type, v_shape, v_raw = q.log[("layers.0.qkv_proj", 2)]
    assert (v_type, v_shape) == ("Q4_1", (192, 576))
    assert torch.equal(v_raw, file["blk.0.attn_v.weight"].raw())
    q_type, q_shape, q_raw = q.log[("layers.0.qkv_proj", 0)]
    assert (q_type, q_shape) == ("Q4_1", (576, 576))
    assert torch.equal(q_raw, file["blk.0.attn_q.weight"].raw()[unpermute_rope_index(576, c.num_heads)])
    assert q.log[("layers.0.down_proj", 0)][:2] == ("Q4_1", (576, 1536))
    assert v_raw.numel() == 192 * 576 // 32 * 20  # 20 bytes per 32 weights: still 4-bit

    packed_model = engine.executor.runner.model
    dense_model = _runner(smollm2, torch.float32).model
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    torch.testing.assert_close(_logits(packed_model, prompt), _logits(dense_model, prompt), rtol=0, atol=1e-5)

    # Served through the engine (paged KV cache, the quantizer's linears), greedy equals the
    # dense model's greedy tokens recomputed from scratch.
    ours = _generate(engine, prompt, 8)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(_logits(dense_model, ids)[-1].argmax()))
    assert ours == ids[len(prompt) :]


# --------------------------------------------------------------------------------------------------
# bf16 safetensors


class DtypeRecorder(TorchDispatchMode):
    """Records the dtype and size of every tensor an aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((str(func), t.dtype, t.numel()))
        return out


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=96,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def test_bf16_safetensors_load_as_bf16_bit_identical_without_fp32(bf16_folder) -> None:
    folder, theirs = bf16_folder
    source = open_model_source(str(folder))
    stored = dict(source.weights())
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}  # yielded as stored

    with torch.device("cpu"):
        model = LLAMA.build(
            source.config, NoQuantizer().linear_factory(), dtype=torch.bfloat16, max_positions=64
        )
    with DtypeRecorder() as rec:
        model.load_weights(source.weights())
    assert rec.made, "the recorder saw the loads"
    fp32 = [(op, n) for op, dtype, n in rec.made if dtype == torch.float32]
    assert fp32 == [], f"loading bf16 weights made fp32 tensors: {fp32[:3]}"

    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    for i in range(2):
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = torch.cat([theirs[att + f"{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(params[f"layers.{i}.qkv_proj.weight"].view(torch.int16), qkv.view(torch.int16))
        bias = torch.cat([theirs[att + f"{p}_proj.bias"] for p in "qkv"])
        assert torch.equal(params[f"layers.{i}.qkv_proj.bias"], bias)
        gate_up = torch.cat([theirs[mlp + "gate_proj.weight"], theirs[mlp + "up_proj.weight"]])
        assert torch.equal(params[f"layers.{i}.gate_up_proj.weight"], gate_up)
        assert torch.equal(params[f"layers.{i}.down_proj.weight"], theirs[mlp + "down_proj.weight"])
    assert torch.equal(params["lm_head.weight"], theirs["lm_head.weight"])
    assert torch.equal(params["embed_tokens.weight"], theirs["model.embed_tokens.weight"])


def test_checkpoint_missing_a_part_names_it(tmp_path: Path, bf16_folder) -> None:
    folder, theirs = bf16_folder
    partial = {k: v for k, v in theirs.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(partial, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    source = open_model_source(str(tmp_path))
    model = LLAMA.build(source.config, NoQuantizer().linear_factory(), dtype=torch.float32, max_positions=64)
    with pytest.raises(ConfigError, match=r"lacks weights for layers\.1\.qkv_proj\.weight \(2 of 3 parts\)"):
        model.load_weights(source.weights())


def test_hf_quantization_config_reaches_model_config(tmp_path: Path, bf16_folder) -> None:
    folder, _ = bf16_folder
    cfg = json.loads((folder / "config.json").read_text())
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"]}},
    }
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    c = ModelSource(tmp_path).config
    assert c.quantization == quant
    assert open_model_source(str(folder)).config.quantization is None


def test_llama_checkpoint_names() -> None:
    tied = ModelConfig(96, 64, 128, 2, 4, 2, 16, tie_word_embeddings=True)
    untied = ModelConfig(96, 64, 128, 2, 4, 2, 16)
    assert llama_checkpoint_name("model.layers.3.self_attn.k_proj.weight", tied) == (
        "layers.3.qkv_proj.weight",
        1,
    )
    assert llama_checkpoint_name("model.layers.3.self_attn.v_proj.bias", tied) == (
        "layers.3.qkv_proj.bias",
        2,
    )
    # A quantizer's own tensors keep their suffix: they reach the parameters its linear made.
    assert llama_checkpoint_name("model.layers.0.mlp.up_proj.weight_scale", tied) == (
        "layers.0.gate_up_proj.weight_scale",
        1,
    )
    assert llama_checkpoint_name("model.layers.0.self_attn.o_proj.weight", tied) == (
        "layers.0.o_proj.weight",
        None,
    )
    assert llama_checkpoint_name("model.layers.0.input_layernorm.weight", tied) == (
        "layers.0.input_layernorm.weight",
        None,
    )
    assert llama_checkpoint_name("lm_head.weight", tied) is None
    assert llama_checkpoint_name("lm_head.weight", untied) == ("lm_head.weight", None)
    assert llama_checkpoint_name("model.layers.0.self_attn.rotary_emb.inv_freq", tied) is None


# --------------------------------------------------------------------------------------------------
# A model architecture only a test plugin knows


TINY_LM = "TinyTestLM"
# Our test checkpoint's naming -> Hugging Face Llama's (the transformers oracle's).
_TINY_TO_HF = {
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "ffn.w1": "mlp.gate_proj",
    "ffn.w3": "mlp.up_proj",
    "ffn.w2": "mlp.down_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
}
_HF_TO_TINY = {v: k for k, v in _TINY_TO_HF.items()}
_FUSED = {"attn.wq": ("qkv_proj", 0), "attn.wk": ("qkv_proj", 1), "attn.wv": ("qkv_proj", 2)}
_FUSED |= {"ffn.w1": ("gate_up_proj", 0), "ffn.w3": ("gate_up_proj", 1)}
_PLAIN = {
    "attn.wo": "o_proj",
    "ffn.w2": "down_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
}


def tiny_checkpoint_name(name: str, config: ModelConfig) -> tuple[str, ShardId | None] | None:
    if name == "tok.weight":
        return "embed_tokens.weight", None
    if name == "final_ln.weight":
        return "norm.weight", None
    if name == "out.weight":
        return "lm_head.weight", None
    m = re.fullmatch(r"blocks\.(\d+)\.(attn\.\w+|ffn\.\w+|ln\d)\.(\w+)", name)
    if m is None:
        raise ConfigError(f"not a TinyTestLM tensor: {name}")
    layer, module, suffix = m.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{suffix}", shard
    return f"layers.{layer}.{_PLAIN[module]}.{suffix}", None


def parse_tiny_config(cfg, name: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["d_model"],
        intermediate_size=cfg["d_ffn"],
        num_layers=cfg["depth"],
        num_heads=cfg["heads"],
        num_kv_heads=cfg["kv_heads"],
        head_dim=cfg["d_model"] // cfg["heads"],
        rms_norm_eps=cfg["eps"],
        rope_theta=cfg["theta"],
        max_position_embeddings=cfg["context"],
        bos_token_id=1,
        eos_token_ids=(2,),
        name=name,
    )


class TinyTestModel(LlamaModel):
    """The plugin's own model class: Llama's layers, its own checkpoint naming."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_named_weights(self, weights, lambda n: tiny_checkpoint_name(n, self.config))


def build_tiny(config: ModelConfig, linear, *, dtype: torch.dtype, max_positions: int) -> nn.Module:
    return TinyTestModel(config, linear, dtype=dtype, max_positions=max_positions)


TINY_ARCHITECTURE = ModelArchitecture(
    name="tiny-test",
    build=build_tiny,
    checkpoint_name=tiny_checkpoint_name,
    hf_architectures=(TINY_LM,),
    parse_hf_config=parse_tiny_config,
)


class TinyModelPlugin:
    @hookimpl
    def lmstack_register_models(self, register):
        register(TINY_ARCHITECTURE)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, hf_smollm2):
    """A TinyTestLM checkpoint (its own config keys and tensor names) and the transformers Llama
    with the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=49152,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
    ).eval()
    with torch.no_grad():  # larger weights keep the random model's greedy path from degenerating
        for p in ref.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    tensors = {}
    for name, t in ref.state_dict().items():
        if name == "model.embed_tokens.weight":
            tensors["tok.weight"] = t
        elif name == "model.norm.weight":
            tensors["final_ln.weight"] = t
        elif name == "lm_head.weight":
            tensors["out.weight"] = t
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
            tensors[f"blocks.{m[1]}.{_HF_TO_TINY[m[2]]}.weight"] = t.contiguous()
    folder = tmp_path_factory.mktemp("tiny_test_lm")
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": [TINY_LM],
        "vocab": 49152,
        "d_model": 64,
        "d_ffn": 128,
        "depth": 2,
        "heads": 4,
        "kv_heads": 2,
        "eps": 1e-5,
        "theta": 10000.0,
        "context": 512,
    }
    (folder / "config.json").write_text(json.dumps(config))
    hf_smollm2[1].save_pretrained(folder)
    return folder, ref


def test_unregistered_architecture_is_one_line_naming_the_installed(tiny_folder) -> None:
    folder, _ = tiny_folder
    with pytest.raises(ConfigError) as info:
        _ = open_model_source(str(folder)).config
    msg = str(info.value)
    assert "\n" not in msg
    assert TINY_LM in msg and "LlamaForCausalLM" in msg and "no installed plugin" in msg


def test_unregistered_gguf_architecture_names_the_installed(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError,
        match=r"GGUF architecture 'mamba' is not served .*\(installed: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe\)$",
    ):
        _ = open_model_source(str(path)).config


def test_model_registry_rejects_a_second_claim_on_a_name() -> None:
    registry = ModelRegistry([LLAMA])
    clash = ModelArchitecture(
        name="other",
        build=build_tiny,
        checkpoint_name=tiny_checkpoint_name,
        gguf_architectures=("llama",),
        parse_gguf_config=LLAMA.parse_gguf_config,
        gguf_tensor=LLAMA.gguf_tensor,
    )
    with pytest.raises(ResolutionError, match="GGUF architecture 'llama' is registered twice"):
        registry.add(clash)
    with pytest.raises(ResolutionError, match="no parse_hf_config"):
        ModelArchitecture(
            name="x", build=build_tiny, checkpoint_name=tiny_checkpoint_name, hf_architectures=("X",)
        )


def test_plugin_architecture_generates_through_the_engine(tiny_folder) -> None:
    folder, ref = tiny_folder
    pm = make_plugin_manager(autoload=False, extra_plugins=[TinyModelPlugin()])
    assert [a.name for a in build_model_registry(pm).architectures] == [
        "llama",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "tiny-test",
    ]
    engine = LLMEngine(
        {
            "model": str(folder),
            "dtype": "float32",
            "allocator": {"num_blocks": 32},
            "scheduler": {"max_num_batched_tokens": 32},  # the 60-token prompt prefills in chunks
        },
        plugin_manager=pm,
    )
    assert engine.source.architecture is TINY_ARCHITECTURE
    assert isinstance(engine.executor.runner.model, TinyTestModel)
    prompt = list(range(1000, 1060))
    ours = _generate(engine, prompt, 12)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            eos_token_id=None,
            pad_token_id=0,
        )
        assert ref(torch.tensor([prompt])).logits[0, -1].std() > 0.5, (
            "the random model should not be degenerate"
        )
    assert ours == out[0, len(prompt) :].tolist()
