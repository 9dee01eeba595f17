"""The mixture-of-experts architecture (`lmstack.model.moe`): our engine's fp32 logits and greedy
tokens equal transformers' on tiny MoE models transformers itself wrote (Mixtral; Qwen2-MoE
with a shared expert and a dense layer), checkpoint names map to our parameters, and the
experts split over ep ranks sum to the whole layer."""

from __future__ import annotations

import pytest
import torch

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks
from lmstack.model.linear import default_linear
from lmstack.model.moe import MoEConfig, MoEModel, SparseMoE, moe_checkpoint_name
from lmstack.model.source import open_model_source
from lmstack.sampling_params import SamplingParams
from lmstack.testing.kit import one_thread, reference_llm, tiny_stack

PROMPT = "the cat sat on the mat, and then the cat sat on the hat"


def _matches_transformers(path, architecture: str) -> None:
    """Teacher-forced log-probabilities over the prompt within 1e-4 and 8 greedy tokens equal."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    llm = reference_llm(tiny_stack(path))
    ids = llm.tokenizer.encode(PROMPT)
    with one_thread():
        out = llm.generate(
            ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        )[0]
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    theirs = torch.stack([logprobs[i - 1, ids[i]] for i in range(1, len(ids))])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == expected.tolist()
    assert len(set(expected.tolist())) >= 4, f"degenerate greedy output {expected.tolist()}"


def test_mixtral_matches_transformers(tiny_moe_path):
    assert type(open_model_source(tiny_moe_path).config) is MoEConfig
    _matches_transformers(tiny_moe_path, "MixtralForCausalLM")


@pytest.fixture(scope="module")
def qwen2_moe_path(tmp_path_factory):
    pytest.importorskip("transformers")
    from lmstack.testing.tiny_moe import write_tiny_moe

    return write_tiny_moe(tmp_path_factory.mktemp("qwen2-moe"), style="qwen2_moe", dense_layers=(1,))


def test_qwen2_moe_with_shared_expert_and_dense_layer_matches_transformers(qwen2_moe_path):
    cfg = open_model_source(qwen2_moe_path).config
    assert isinstance(cfg, MoEConfig)
    assert (cfg.norm_topk_prob, cfg.dense_layers, cfg.attention_bias, cfg.output_bias) == (
        False,
        (1,),
        True,
        False,
    )
    assert cfg.shared_expert_intermediate_size > 0
    _matches_transformers(qwen2_moe_path, "Qwen2MoeForCausalLM")


@pytest.mark.parametrize("rank", [0, 1])
def test_an_ep_rank_loads_only_its_experts(qwen2_moe_path, rank):
    """ep: 2 without processes: rank 1 reads the checkpoint skipping experts 0-1 and the shared
    expert; rank 0 skipping experts 2-3. Neither lacks a weight nor meets a stray one."""
    source = open_model_source(qwen2_moe_path)
    model = MoEModel(source.config, ranks=ParallelRanks(ep=2, rank=rank))
    model.load_weights(source.weights())
    experts = {n.split(".")[4] for n, _ in model.named_parameters() if ".moe.experts." in n}
    assert experts == {str(2 * rank), str(2 * rank + 1)}
    assert any(".shared_expert." in n for n, _ in model.named_parameters()) == (rank == 0)
    assert model.layers[1].moe is None  # the dense layer


def test_checkpoint_names():
    cfg = MoEConfig(10, 8, 16, 2, 2, 2, 4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cases = {
        "model.layers.1.block_sparse_moe.experts.3.w1.weight": (
            "layers.1.moe.experts.3.gate_up_proj.weight",
            0,
        ),
        "model.layers.1.block_sparse_moe.experts.3.w3.weight": (
            "layers.1.moe.experts.3.gate_up_proj.weight",
            1,
        ),
        "model.layers.1.block_sparse_moe.experts.3.w2.weight": (
            "layers.1.moe.experts.3.down_proj.weight",
            None,
        ),
        "model.layers.0.block_sparse_moe.gate.weight": ("layers.0.moe.gate.weight", None),
        "model.layers.0.mlp.experts.2.up_proj.weight": ("layers.0.moe.experts.2.gate_up_proj.weight", 1),
        "model.layers.0.mlp.shared_expert.down_proj.weight": (
            "layers.0.moe.shared_expert.down_proj.weight",
            None,
        ),
        "model.layers.0.mlp.shared_expert_gate.weight": ("layers.0.moe.shared_expert_gate.weight", None),
        "model.layers.0.mlp.gate_proj.weight": ("layers.0.gate_up_proj.weight", 0),  # a dense layer
        "model.layers.0.self_attn.k_proj.weight": ("layers.0.qkv_proj.weight", 1),
    }
    for name, target in cases.items():
        assert moe_checkpoint_name(name, cfg) == target, name
    with pytest.raises(ConfigError, match="unknown expert projection 'w4'"):
        moe_checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w4.weight", cfg)


@pytest.mark.parametrize("shared", [0, 24])
def test_experts_split_over_ep_ranks_sum_to_the_whole_layer(shared):
    """Each ep rank's layer holds only its experts (and rank 0 the shared expert); the sum of
    the ranks' partial outputs, which the moe all-reduce computes, is the one-rank output."""
    cfg = MoEConfig(
        10, 16, 32, 1, 2, 2, 8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        norm_topk_prob=not shared, shared_expert_intermediate_size=shared,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    whole = SparseMoE(cfg, "layers.0.moe", default_linear, torch.float32, ParallelRanks())
    params = {n: torch.randn(p.shape, generator=gen) for n, p in whole.named_parameters()}
    whole.load_state_dict(params)
    x = torch.randn(7, 16, generator=gen)
    parts = []
    for rank in range(2):
        part = SparseMoE(cfg, "layers.0.moe", default_linear, torch.float32, ParallelRanks(ep=2, rank=rank))
        mine = dict(part.named_parameters())
        assert list(part.local) == [2 * rank, 2 * rank + 1]
        assert all(f"experts.{e}." not in n for n in mine for e in range(4) if e not in part.local)
        assert (part.shared_expert is not None) == (bool(shared) and rank == 0)
        part.load_state_dict({n: params[n] for n in mine})
        parts.append(part(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-5, rtol=1e-5)
