"""Gemma 2 and Gemma 3 (text) from Hugging Face folders (`lmstack.model.gemma`): on tiny models
transformers itself wrote (`lmstack.testing.tiny_gemma`), our fp32 log-probabilities are within
1e-4 of transformers' and greedy tokens equal, with the torch and the cpu-paged attention
kernels, over prompts that cross the 8-token sliding window and the 16-token prefill chunk;
config.json variants parse into the decoder's switches; a kernel that cannot soft-cap is
refused at resolution with the reason and the way out."""

from __future__ import annotations

import json

import pytest
import torch

from lmstack.errors import ConfigError, ResolutionError
from lmstack.model.gemma import parse_gemma2_config, parse_gemma3_config
from lmstack.model.source import open_model_source
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack

transformers = pytest.importorskip("transformers")

# ~45 tokens and ~9 of the tiny byte-level tokenizer: the long one is cut into 16-token chunks
# and both cross the window (8) in prefill, the short one again while decoding.
PROMPTS = (
    "the cat sat on the mat, and then the cat sat on the hat; one two three four",
    "in the beginning",
)
NEW_TOKENS = 12
CHUNK = 16  # scheduler.max_num_batched_tokens: prompts longer than this are prefilled in chunks


@pytest.fixture(scope="module", params=[2, 3], ids=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    from lmstack.testing.tiny_gemma import write_tiny_gemma

    version = request.param
    return version, write_tiny_gemma(version, tmp_path_factory.mktemp(f"gemma{version}"))


def _hf(path):
    # eager: transformers' own reference path (its SDPA path cannot soft-cap scores).
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _stack(path, attention: str) -> dict:
    sections: dict = {"scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": CHUNK}}
    if attention != "torch":
        sections["attention"] = {"prefill": {"name": attention}, "decode": {"name": attention}}
    return tiny_stack(path, **sections)


def _llm(path, attention: str):
    if attention == "torch":
        return reference_llm(_stack(path, "torch"))
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import default_registry

    if attention not in default_registry().names("attention"):
        pytest.skip(f"the {attention!r} attention plugin is not installed")
    if attention == "cpu-paged":
        from lmstack_cpu_paged.build import load_error

        if (problem := load_error()) is not None:
            pytest.skip(f"cpu-paged cannot be built here: {problem}")
    return LLM(_stack(path, attention))


def _matches_transformers(path, attention: str, *, diverse: bool = True) -> None:
    """Teacher-forced log-probabilities of every prompt token and of every generated token within
    1e-4 of transformers', and transformers' greedy tokens, both prompts in one batch."""
    hf = _hf(path)
    llm = _llm(path, attention)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[0]) > 2 * CHUNK and len(prompts[1]) > 8, [len(p) for p in prompts]
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    with one_thread():
        outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad(), one_thread():
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            generated = out.outputs[0].token_ids
            assert generated == expected, f"{attention}: prompt of {len(ids)} tokens"
            if diverse:
                assert len(set(expected)) >= 6, f"degenerate greedy output {expected}"
            # Every position of prompt + generated tokens, teacher-forced through transformers.
            full = ids + generated
            theirs = hf(torch.tensor([full])).logits[0].log_softmax(-1)
        want = torch.stack([theirs[i - 1, full[i]] for i in range(1, len(full))])
        ours = [out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
        ours += [lp[tok] for lp, tok in zip(out.outputs[0].logprobs, generated, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["torch", "cpu-paged"])
def test_matches_transformers(gemma, attention):
    _, path = gemma
    _matches_transformers(path, attention)


def test_tied_head_matches_transformers(tmp_path):
    """Gemma's own layout, the head tied to the embedding (the tiny model then repeats itself,
    so only agreement is checked, not diverse output)."""
    from lmstack.testing.tiny_gemma import write_tiny_gemma

    path = write_tiny_gemma(2, tmp_path, tie_word_embeddings=True)
    assert open_model_source(path).config.tie_word_embeddings
    _matches_transformers(path, "torch", diverse=False)


def test_gemma3_with_scaled_global_rope_matches_transformers(tmp_path):
    """Gemma 3 4B and larger scale the global layers' RoPE (linear, factor 8) and leave the local
    layers' alone: each layer must take its own table."""
    from lmstack.testing.tiny_gemma import write_tiny_gemma

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    path = write_tiny_gemma(3, tmp_path, rope_parameters=rope)
    cfg = open_model_source(path).config
    assert (cfg.rope_scaling, cfg.rope_local_theta) == ({"rope_type": "linear", "factor": 8.0}, 1e4)
    _matches_transformers(path, "torch")


def test_the_fixture_exercises_every_switch(gemma):
    """The tiny models are sensitive to what the test checks: transformers' own logits move by
    far more than the tolerance when the window, the attention scale or a soft-cap is changed,
    so a kernel or a parser that dropped one could not pass `test_matches_transformers`."""
    version, path = gemma
    hf = _hf(path)
    ids = torch.tensor([open_model_source(path).tokenizer.encode(PROMPTS[0])])
    with torch.no_grad():
        base = hf(ids).logits
    changes = {"sliding_window": 4096, "query_pre_attn_scalar": hf.config.head_dim}
    if version == 2:
        changes |= {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    for key, value in changes.items():
        config = hf.config.__class__(**{**hf.config.to_dict(), key: value})
        other = type(hf)(config).eval()
        other.load_state_dict(hf.state_dict())
        with torch.no_grad():
            moved = (other(ids).logits - base).abs().max().item()
        assert moved > 1e-2, f"{key}: logits moved by {moved:.1e} only"


def test_gemma2_config_switches(gemma):
    version, path = gemma
    cfg = open_model_source(path).config
    assert (cfg.norm_weight_offset, cfg.sandwich_norms, cfg.hidden_act) == (1.0, True, "gelu_pytorch_tanh")
    assert cfg.embedding_multiplier == 8.0 and not cfg.tie_word_embeddings  # the fixture's (see there)
    assert cfg.attn_scale == pytest.approx(20**-0.5)
    if version == 2:
        assert cfg.layer_sliding_windows == (8, None, 8, None)
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.qk_norm) == (3.0, 8.0, False)
        assert cfg.rope_local_theta is None
    else:
        assert cfg.layer_sliding_windows == (8, 8, 8, 8, 8, None)
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.qk_norm) == (None, None, True)
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


GEMMA2_OLD = {  # as google/gemma-2-2b's config.json (before transformers wrote layer_types)
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
}
GEMMA3_OLD = {  # as google/gemma-3-1b-it's config.json
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
}


def test_configs_written_before_layer_types():
    """Published configs without `layer_types`: windows as transformers derives them (Gemma 2:
    even layers local; Gemma 3: every sixth layer global), Gemma 3's local base from
    `rope_local_base_freq`, tied embeddings by default."""
    g2 = parse_gemma2_config(GEMMA2_OLD, "gemma-2-2b")
    assert g2.layer_sliding_windows == tuple(4096 if i % 2 == 0 else None for i in range(26))
    assert (g2.attn_scale, g2.attn_logit_softcap, g2.final_logit_softcap) == (1 / 16, 50.0, 30.0)
    assert g2.tie_word_embeddings and g2.embedding_multiplier == pytest.approx(48.0)
    g3 = parse_gemma3_config(GEMMA3_OLD, "gemma-3-1b-it")
    assert g3.layer_sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling, g3.qk_norm) == (1e6, 1e4, None, True)
    # A global-layer RoPE scaling (gemma-3-4b and larger: linear, factor 8) stays global.
    g3 = parse_gemma3_config({**GEMMA3_OLD, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "g")
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 8.0} and g3.rope_local_theta == 1e4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_pre_attn_scalar": None}, "lacks 'query_pre_attn_scalar'"),
        ({"rope_local_base_freq": None}, "lacks 'rope_local_base_freq'"),
        ({"hidden_activation": "relu"}, "activation 'relu' is not implemented"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["chunked_attention"] * 26}, "layer type 'chunked_attention' is not implemented"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "RoPE scaling 'linear' on the sliding-window layers is not implemented",
        ),
    ],
)
def test_what_is_not_implemented_is_one_line(change, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_gemma3_config({**GEMMA3_OLD, **change}, "gemma-3-1b-it")
    assert "\n" not in str(err.value)


def test_multimodal_gemma3_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    )
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration") as err:
        _ = open_model_source(tmp_path).config
    assert "Gemma3ForCausalLM" in str(err.value) and "\n" not in str(err.value)


def test_a_kernel_that_cannot_soft_cap_is_refused(gemma):
    """Gemma 2 soft-caps its scores: a kernel that does not declare `logit_softcap` is refused
    by `check_model` in one line naming the kernel, the cap, where to choose another and which
    installed ones fit; Gemma 3 (no cap) is accepted by it. A kernel without sliding windows is
    refused for both (their local layers)."""
    from lmstack.registry import Component
    from lmstack.stack.checks import check_model
    from lmstack.stack.config import load_stack
    from lmstack.stack.plugins import build_registry, make_plugin_manager
    from lmstack.stack.resolve import resolve

    version, path = gemma
    config = open_model_source(path).config
    registry = build_registry(make_plugin_manager(autoload=False))
    for name, caps in (("no-softcap", {"sliding_window": True}), ("no-window", {"sliding_window": False})):
        registry.add(Component(name=name, kind="attention", factory=lambda o, c: None, capabilities=caps))

    def check(attention: str, with_registry: bool = True) -> None:
        stack = resolve(load_stack({"model": str(path), "device": "cpu", "attention": attention}), registry)
        check_model(stack, config, registry if with_registry else None)

    check("torch")
    with pytest.raises(ResolutionError, match=r"'no-window'.*sliding-window.*8-token window"):
        check("no-window")
    if version == 3:
        check("no-softcap")
        return
    for with_registry, fits in ((True, "installed ones that fit: torch"), (False, "built-in torch kernel")):
        with pytest.raises(ResolutionError) as err:
            check("no-softcap", with_registry)
        message = str(err.value)
        assert "\n" not in message
        for part in ("'no-softcap'", "soft-capping", "at 3 (attn_logit_softcap)", "attention.prefill", fits):
            assert part in message, (part, message)


def test_kv_calibration_attends_as_the_model_does():
    """A float8 KV cache's scales come from one calibration forward (`lmstack.quant.kv`): its
    attention takes each layer's window, the model's scale and its soft-cap, so later layers'
    K/V (whose magnitudes set the scales) are the ones the model will serve."""
    from lmstack.model.config import ModelConfig
    from lmstack.quant.kv import _AmaxRecorder
    from lmstack.testing.attention import reference_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(37, h, 16, generator=gen) for h in (6, 2, 2))
    cfg = ModelConfig(
        10, 8, 8, 3, 6, 2, 16, layer_sliding_windows=(5, None, 5), attn_scale=0.3, attn_logit_softcap=2.0
    )
    for layer in range(3):
        got = _AmaxRecorder(cfg).attend(layer, q, k, v)
        want = reference_attention(q, k, v, 0, 0.3, cfg.layer_window(layer), 2.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    plain = reference_attention(q, k, v, 0, 16**-0.5)
    torch.testing.assert_close(_AmaxRecorder().attend(1, q, k, v), plain, atol=1e-5, rtol=0)
    assert (_AmaxRecorder(cfg).attend(1, q, k, v) - plain).abs().max() > 0.1
