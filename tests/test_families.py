"""The decoder families (`lmstack.model.llama`'s switches, `lmstack.model.moe`'s Qwen3-MoE) on tiny
random models transformers itself wrote (`lmstack.testing.tiny_families`): fp32 log-probabilities
within 1e-4 of transformers' and greedy tokens equal, over a prompt that crosses the sliding
window (where the family has one) and several chunked-prefill boundaries, with the torch and the
cpu-paged attention; the RoPE tables of Llama 3 scaling, YaRN and LongRoPE against transformers'
own; config variants we do not implement refused in one line; and the plugins that change how a
model runs (int8, tp, ngram) on a non-Llama family."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmstack.errors import ConfigError
from lmstack.model.source import open_model_source
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack

transformers = pytest.importorskip("transformers")

from lmstack.testing.tiny_families import FAMILIES, PHI3_ORIGINAL_CONTEXT, WINDOW, write_tiny_family  # noqa: E402

# ~82 tokens of the tiny tokenizer: past the 32-token windows, and 3 chunks of 32 tokens.
TEXT = "in the beginning there was the word, and the word was in the beginning; " * 2
CHUNK = 32
MAX_NEW = 8


@pytest.fixture(scope="session")
def family_path(tmp_path_factory) -> Callable[..., Path]:
    """family_path(family, **overrides): the tiny model's folder, written once per session."""
    paths: dict[tuple, Path] = {}

    def get(family: str, **overrides: Any) -> Path:
        key = (family, *sorted(overrides.items()))
        if key not in paths:
            paths[key] = write_tiny_family(family, tmp_path_factory.mktemp(f"tiny-{family}"), **overrides)
        return paths[key]

    return get


def _attention(name: str) -> dict[str, Any]:
    if name == "cpu-paged":
        from lmstack.stack.plugins import default_registry

        if name not in default_registry().names("attention"):
            pytest.skip("the cpu-paged attention plugin is not installed")
        from lmstack_cpu_paged.build import load_error

        if (problem := load_error()) is not None:
            pytest.skip(f"cpu-paged cannot be built here: {problem}")
    return {"prefill": {"name": name}, "decode": {"name": name}}


def _stack(path: Path, attention: str = "torch", **sections: Any) -> dict[str, Any]:
    stack = tiny_stack(path, attention=_attention(attention), **sections)
    stack["scheduler"] = {**stack["scheduler"], "max_num_batched_tokens": CHUNK}
    return stack


_HF: dict[tuple, tuple[torch.Tensor, list[int]]] = {}


def _transformers(path: Path, ids: list[int], hf=None) -> tuple[torch.Tensor, list[int]]:
    """transformers' teacher-forced log-probabilities of ids[1:] and its greedy continuation
    (the model saved at `path`, or `hf`)."""
    key = (str(path), tuple(ids), id(hf))
    if key not in _HF:
        if hf is None:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        with one_thread(), torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
        _HF[key] = (torch.stack([logprobs[i - 1, ids[i]] for i in range(1, len(ids))]), out.tolist())
    return _HF[key]


_ENGINES: dict[str, Any] = {}


def _engine(stack: dict[str, Any]):
    """An `LLM` with the installed plugins (cpu-paged among them), shared per distinct stack."""
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    key = json.dumps(stack, sort_keys=True, default=str)
    if key not in _ENGINES:
        _ENGINES[key] = LLM(dict(stack), plugin_manager=make_plugin_manager())
    return _ENGINES[key]


def _matches_transformers(path: Path, stack: dict[str, Any], text: str = TEXT, hf=None) -> list[int]:
    llm = _engine(stack)
    ids = llm.tokenizer.encode(text)
    with one_thread():
        out = llm.generate(
            ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
        )[0]
    theirs, expected = _transformers(path, ids, hf)
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == expected
    assert len(set(expected)) >= 3, f"degenerate greedy output {expected}"
    return ids


@pytest.mark.parametrize("attention", ["torch", "cpu-paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(family_path, family, attention):
    path = family_path(family)
    ids = _matches_transformers(path, _stack(path, attention))
    cfg = open_model_source(path).config
    assert len(ids) > 2 * CHUNK  # several prefill chunks
    if cfg.sliding_window is not None:
        assert cfg.sliding_window == WINDOW < len(ids)


def test_family_switches_are_read_from_the_checkpoints(family_path):
    configs = {family: open_model_source(family_path(family)).config for family in FAMILIES}
    assert configs["llama3"].rope_scaling["rope_type"] == "llama3" and configs["llama3"].tie_word_embeddings
    assert configs["mistral"].sliding_window == WINDOW
    assert configs["qwen2"].attention_bias and not configs["qwen2"].output_bias
    assert configs["qwen2"].sliding_window is None
    assert configs["qwen3"].qk_norm and configs["qwen3_moe"].qk_norm
    assert configs["qwen3_moe"].num_experts == 4 and configs["qwen3_moe"].norm_topk_prob
    phi3 = configs["phi3"]
    assert phi3.partial_rotary_factor == 0.5 and phi3.rotary_dim == 32 and phi3.sliding_window == WINDOW
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == PHI3_ORIGINAL_CONTEXT
    for family, cfg in configs.items():
        assert not (cfg.sandwich_norms or cfg.norm_weight_offset or cfg.embedding_multiplier), family


def test_llama3_untied_head_matches_transformers(family_path):
    path = family_path("llama3", tie_word_embeddings=False)
    assert not open_model_source(path).config.tie_word_embeddings
    _matches_transformers(path, _stack(path))


def test_phi3_within_its_original_context_uses_the_short_factors(family_path):
    """A stack whose context fits Phi-3's original one (max_model_len 64) rotates with the short
    LongRoPE factors, as transformers does for every sequence that short; the default (the
    config's 1024 positions) with the long ones, as transformers does past 64 tokens (the
    parametrised test above)."""
    path = family_path("phi3")
    short_text = TEXT[: len(TEXT) // 2 + 10]  # ~45 tokens + 8 new: past the window, within 64
    stack = {**_stack(path), "max_model_len": PHI3_ORIGINAL_CONTEXT}
    ids = _matches_transformers(path, stack, short_text)
    assert WINDOW < len(ids) and len(ids) + MAX_NEW <= PHI3_ORIGINAL_CONTEXT


@pytest.mark.parametrize("attention", ["torch", "cpu-paged"])
def test_qwen2_sliding_window_on_the_upper_layers_matches_transformers(family_path, attention):
    """Qwen2's `use_sliding_window` with `max_window_layers`: layer 0 attends to everything,
    layer 1 to its last 32 tokens (per-layer windows through the attention interface)."""
    path = family_path("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    cfg = open_model_source(path).config
    assert cfg.layer_sliding_windows == (None, WINDOW) and cfg.sliding_window is None
    _matches_transformers(path, _stack(path, attention))


# --- RoPE tables against transformers' rotary embeddings ---------------------------------------


# transformers computes the inverse frequencies in fp32, we in fp64 rounded once: an ulp apart,
# which at position ~1000 moves an angle by up to ~6e-5. A wrong formula moves them by far more.
ANGLE_ATOL = 1e-4


def _hf_rotary(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos / sin [P, rotated dims / 2] for `config` at these positions (one
    forward over all of them, as a prefill of that length computes them)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = Phi3RotaryEmbedding if config.model_type == "phi3" else LlamaRotaryEmbedding
    rotary = cls(config=config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _our_tables(path_or_cfg: dict, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lmstack.model.hf_loader import parse_llama_config, parse_phi3_config
    from lmstack.model.rope import RotaryEmbedding

    parse = parse_phi3_config if path_or_cfg.get("model_type") == "phi3" else parse_llama_config
    cfg = parse(path_or_cfg, "t")
    rope = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
    return rope.cos, rope.sin


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.8,
         "mscale_all_dim": 0.5, "beta_fast": 16},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},  # transformers scales only past 1024 positions
    ],
)  # fmt: skip
def test_rope_scaling_tables_match_transformers(scaling):
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={**scaling, "rope_theta": 500000.0},
    )
    ours = _our_tables(config.to_dict(), 1024)
    theirs = _hf_rotary(config, torch.arange(1024))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=ANGLE_ATOL, rtol=0)


@pytest.mark.parametrize("context", [64, 1024])
def test_longrope_tables_match_transformers(family_path, context):
    """Phi-3's partial rotary LongRoPE: with a context within the original 64 positions, the
    short factors (transformers' for a 64-token sequence); past it, the long ones and the
    attention factor sqrt(1 + ln(16) / ln(64)) (transformers' for a longer sequence)."""
    path = family_path("phi3")
    config = transformers.AutoConfig.from_pretrained(path)
    ours = _our_tables(config.to_dict(), context)
    theirs = _hf_rotary(config, torch.arange(context))
    assert ours[0].shape == (context, 16)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=ANGLE_ATOL, rtol=0)
    if context > PHI3_ORIGINAL_CONTEXT:  # the long table is not the short one
        short = _our_tables(config.to_dict(), PHI3_ORIGINAL_CONTEXT)
        assert not torch.allclose(ours[0][:PHI3_ORIGINAL_CONTEXT], short[0])


# --- what is refused ---------------------------------------------------------------------------


def _edited(family_path, tmp_path: Path, family: str, edit: Callable[[dict], None]) -> Path:
    """A copy of the family's folder (links to its files) with config.json edited."""
    source = family_path(family)
    folder = tmp_path / family
    folder.mkdir()
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    cfg = json.loads((source / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _set(**keys: Any) -> Callable[[dict], None]:
    return lambda cfg: cfg.update(keys)


def _rope(**keys: Any) -> Callable[[dict], None]:
    return lambda cfg: cfg["rope_parameters"].update(keys)


@pytest.mark.parametrize(
    ("family", "edit", "fragment"),
    [
        ("llama3", _rope(rope_type="su-per"), "RoPE scaling type 'su-per' is not implemented"),
        ("llama3", _rope(rope_type="yarn", mscale_all_dim=1, truncate=True, extra=1), "has 'extra'"),
        ("phi3", lambda c: c["rope_parameters"].pop("long_factor"), "lacks 'long_factor'"),
        ("phi3", _rope(short_factor=[1.0] * 5), "short_factor has 5 entries"),
        ("phi3", _rope(partial_rotary_factor=0.3), "it must be an even number"),
        ("qwen3", _set(hidden_act="relu2"), "activation 'relu2' is not implemented"),
        ("qwen2", _set(layer_types=["full_attention", "chunked_attention"]), "'chunked_attention'"),
        ("qwen3_moe", _set(shared_expert_intermediate_size=64), "shared expert is not implemented"),
        ("qwen3_moe", _set(hidden_act="gelu_pytorch_tanh"), "experts with activation"),
        ("mistral", lambda c: c.pop("num_attention_heads"), "lacks 'num_attention_heads'"),
        ("qwen3_moe", lambda c: c.pop("moe_intermediate_size"), "lacks 'moe_intermediate_size'"),
    ],
)
def test_unimplemented_variants_are_one_line_at_check(family_path, tmp_path, capsys, family, edit, fragment):
    """`lmstack check` on a stack naming the edited model: one line naming the variant."""
    from lmstack import cli

    folder = _edited(family_path, tmp_path, family, edit)
    capsys.readouterr()  # what writing the fixture printed
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(f"model: {folder}\ndtype: float32\ndevice: cpu\n")
    code = cli.main(["check", str(stack_file)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert fragment in err
    with pytest.raises(ConfigError, match="config.json of model"):
        _ = open_model_source(folder).config


def test_a_fused_tensor_of_the_wrong_size_is_named(family_path, tmp_path):
    """A Phi-3 checkpoint whose qkv_proj does not have the config's q + k + v rows."""
    from lmstack.model.llama import LlamaModel

    source = open_model_source(family_path("phi3"))
    cfg = source.config
    model = LlamaModel(cfg)
    weights = (
        (n, t[:-64] if n.endswith("layers.1.self_attn.qkv_proj.weight") else t) for n, t in source.weights()
    )
    with pytest.raises(ConfigError, match=r"qkv_proj.weight' has 448 rows; .* q_proj 256 \+ k_proj 128"):
        model.load_weights(weights)


# --- other plugins on a non-Llama family -------------------------------------------------------

PROMPTS = [TEXT, "one two one two one two one two one two one two", "the cat sat on the mat"]


def _greedy(llm, max_tokens: int = 12) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with one_thread():
        return [o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), sp)]


def _llm(stack: dict[str, Any]):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    return LLM(stack, plugin_manager=make_plugin_manager())


def test_ngram_speculation_on_qwen3_gives_plain_greedy_tokens(family_path):
    pytest.importorskip("lmstack_ngram")
    path = family_path("qwen3")
    plain = _greedy(reference_llm(_stack(path)), 16)
    llm = _llm(_stack(path, speculator={"name": "ngram", "adaptive": False}))
    try:
        assert _greedy(llm, 16) == plain
        stats = llm.get_stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("quantizer", "family", "options"),
    [
        ("int8", "qwen2", {"fp32_activations": "exact", "lm_head": "dense"}),
        ("rtn-int4", "qwen3", {"fp32_activations": "exact", "lm_head": "dense"}),
    ],
)
def test_quantized_weights_match_transformers_on_the_same_weights(family_path, quantizer, family, options):
    """A quantizer that quantizes a dense checkpoint at load, on a non-Llama family (Qwen2: biased
    q/k/v, unbiased o; Qwen3: q/k norms, heads wider than hidden / heads): transformers given
    our layers' dequantized weights is the oracle (log-probabilities within 1e-4, greedy tokens
    equal): the quantized model computes what its weights say, norms and biases untouched."""
    plugin = {"int8": "lmstack_int8", "rtn-int4": "lmstack_awq"}[quantizer]
    pytest.importorskip(plugin)
    path = family_path(family)
    stack = _stack(path, quant={"weights": quantizer, **options})
    llm = _engine(stack)
    layers = llm.engine.executor.runner.model.layers
    assert all(hasattr(layer.qkv_proj, "dequantized_weight") for layer in layers)
    assert (layers[0].qkv_proj.bias is not None, layers[0].o_proj.bias is not None) == (
        family == "qwen2",
        False,
    )

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    cfg = open_model_source(path).config
    with torch.no_grad():
        for ours, theirs in zip(layers, hf.model.layers, strict=True):
            q, k, v = ours.qkv_proj.dequantized_weight().split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            gate, up = ours.gate_up_proj.dequantized_weight().chunk(2)
            attn, mlp = theirs.self_attn, theirs.mlp
            for param, value in [
                (attn.q_proj.weight, q), (attn.k_proj.weight, k), (attn.v_proj.weight, v),
                (attn.o_proj.weight, ours.o_proj.dequantized_weight()), (mlp.gate_proj.weight, gate),
                (mlp.up_proj.weight, up), (mlp.down_proj.weight, ours.down_proj.dequantized_weight()),
            ]:  # fmt: skip
                assert not torch.equal(param, value)  # quantization changed every weight
                param.copy_(value)
    _matches_transformers(path, stack, hf=hf.eval())


@pytest.mark.slow
def test_tp2_on_qwen3_gives_single_process_greedy_tokens(family_path):
    """tp=2 over two worker processes: Qwen3's q/k norms on each rank's heads, its attention
    wider than the hidden size split by heads. (Phi-3's fused tensors under tp: the tp=4 test
    below, without processes.)"""
    pytest.importorskip("lmstack_tp")
    path = family_path("qwen3")
    plain = _greedy(reference_llm(_stack(path)))
    llm = _llm({**_stack(path), "parallel": {"name": "tp", "tp": 2}})
    try:
        assert llm.engine.executor.world_size == 2
        assert _greedy(llm) == plain
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("rank", range(4))
def test_fused_phi3_tensors_split_then_replicate_kv_heads_under_tp4(family_path, rank):
    """tp=4 over 2 KV heads (each replicated on 2 ranks), without processes: rank r's qkv_proj
    holds query head r and KV head r // 2 cut from Phi-3's fused qkv_proj tensor, and its
    gate_up_proj a quarter of the fused gate_up_proj's gate rows and of its up rows."""
    from lmstack.exec.distributed import ParallelRanks
    from lmstack.model.hf_loader import iter_safetensors
    from lmstack.model.llama import LlamaModel

    source = open_model_source(family_path("phi3"))
    cfg = source.config
    model = LlamaModel(cfg, ranks=ParallelRanks(tp=4, rank=rank))
    model.load_weights(source.weights())
    stored = dict(iter_safetensors(source.path))
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]
    d, kv_head = cfg.head_dim, rank // 2
    q = qkv[rank * d : (rank + 1) * d]
    k = qkv[cfg.q_size + kv_head * d : cfg.q_size + (kv_head + 1) * d]
    v = qkv[cfg.q_size + cfg.kv_size + kv_head * d : cfg.q_size + cfg.kv_size + (kv_head + 1) * d]
    assert torch.equal(model.layers[1].qkv_proj.weight, torch.cat([q, k, v]))
    gate_up, inter = stored["model.layers.1.mlp.gate_up_proj.weight"], cfg.intermediate_size
    quarter = slice(rank * inter // 4, (rank + 1) * inter // 4)
    expected = torch.cat([gate_up[:inter][quarter], gate_up[inter:][quarter]])
    assert torch.equal(model.layers[1].gate_up_proj.weight, expected)


def test_the_llama_fast_path_is_chosen_when_every_switch_is_off(family_path):
    """Llama 3 layers run the one native split-and-rotate call, SwiGLU and the Llama forward
    (no switch tested per call); Qwen3 (q/k norm) and Phi-3 (partial rotary) the general split."""
    from lmstack.model.layer_ops import qkv_rope_, silu_mul
    from lmstack.model.llama import LlamaModel

    def layer(family: str):
        return LlamaModel(open_model_source(family_path(family)).config).layers[0]

    llama = layer("llama3")
    assert llama.split_qkv is qkv_rope_ and llama.act is silu_mul and "forward" not in vars(llama)
    assert llama.q_norm is None and not hasattr(llama, "pre_feedforward_layernorm")
    for family in ("qwen3", "phi3"):
        general = layer(family)
        assert general.split_qkv == general.split_qkv_general
