"""The `ep` layout on the tiny Mixtral transformers wrote (`tiny_moe_path`): the parallel kit
passes with the experts on two worker processes (greedy tokens equal the single process's,
which equal transformers'), and a degree that does not split the experts (or a dense model) is
refused before any worker starts; `ep: 2 × tp: 2` gives the same tokens on four."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmstack.engine.llm import LLM
from lmstack.errors import BuildError, ResolutionError
from lmstack.model.moe import MoEConfig
from lmstack.testing import ParallelConformance
from lmstack.testing.kit import KIT_PROMPTS, greedy, one_thread, reference_llm, tiny_stack

# The geometry of `write_tiny_moe`'s default model, for the kit's factory-only checks.
TINY_MOE_CONFIG = MoEConfig(
    vocab_size=275,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    name="tiny-moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
)


class TestEpConformance(ParallelConformance):
    component = "ep"
    options = {"ep": 2}

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model_path(cls, tiny_moe_path):
        """The kit's end-to-end model, here the MoE one: ep has no experts to split in the Llama."""
        return tiny_moe_path

    def build(self, overrides=None, **ctx_parts: Any) -> Any:
        return super().build(overrides, **{"model_config": TINY_MOE_CONFIG, **ctx_parts})


def test_single_process_greedy_tokens_equal_transformers(tiny_moe_path):
    """With the kit's check (ep: 2 gives the single-process tokens on the same prompts and
    lengths), ep: 2's greedy tokens equal transformers'; one ep engine less in the suite."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    llm = reference_llm(tiny_stack(tiny_moe_path))
    ours = greedy(llm, list(KIT_PROMPTS), TestEpConformance.max_tokens)
    for prompt, out in zip(KIT_PROMPTS, ours):
        ids = llm.tokenizer.encode(prompt)
        with one_thread(), torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=TestEpConformance.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
        assert out.token_ids == expected.tolist(), prompt


def test_ep2_tp2_greedy_tokens_equal_single_process(tiny_moe_path):
    """4 workers: each ep rank's two experts split over its tp pair, attention heads and
    vocabulary split over the tp pairs; tokens as in one process (hence as transformers')."""
    prompts, n = list(KIT_PROMPTS[:2]), 8
    llm = LLM(tiny_stack(tiny_moe_path, parallel={"name": "ep", "ep": 2, "tp": 2}))
    try:
        assert llm.engine.executor.world_size == 4
        ours = greedy(llm, prompts, n)
    finally:
        llm.engine.shutdown()
    theirs = greedy(reference_llm(tiny_stack(tiny_moe_path)), prompts, n)
    assert [o.token_ids for o in ours] == [t.token_ids for t in theirs]


@pytest.mark.parametrize(
    ("model", "ep", "tp", "message"),
    [
        ("moe", 3, 1, r"parallel.ep: ep=3 does not divide the 4 experts of model .*; ep can be 1, 2 or 4"),
        ("dense", 2, 1, r"parallel.ep: model .* is not a mixture-of-experts model"),
        ("moe", 2, 3, r"parallel.tp: tp=3 does not divide model .*; tp can be 1, 2 or 4"),
    ],
)
def test_a_degree_that_does_not_split_the_model_is_refused(
    tiny_moe_path, tiny_model_path, model, ep, tp, message
):
    path = tiny_moe_path if model == "moe" else tiny_model_path
    # The stack's tp is checked against the model while resolving; ep by the layout's factory.
    with pytest.raises((BuildError, ResolutionError), match=message):
        LLM(tiny_stack(path, parallel={"name": "ep", "ep": ep, "tp": tp}))


def test_a_cache_that_moves_blocks_off_the_device_is_refused_with_tp(tiny_moe_path, tmp_path):
    pytest.importorskip("lmstack_tiered_cache")
    cache = {"name": "tiered", "disk_path": str(tmp_path)}
    with pytest.raises(ResolutionError, match=r"parallel layout 'ep' .*cache 'tiered' moves blocks to"):
        LLM(tiny_stack(tiny_moe_path, parallel={"name": "ep", "ep": 2, "tp": 2}, cache=cache))
