"""Pipeline stages in one process: micro-batch splitting, what a stage builds and loads, and a
chain of stage models (hidden states handed on by hand) equal to the whole model."""

from __future__ import annotations

import pytest
import torch
from lmstack_pp.microbatch import split_plan, split_points

from lmstack.batch import SeqPlan, StepPlan
from lmstack.components.none_quantizer import NoQuantizer
from lmstack.components.torch_attention import TorchAttention
from lmstack.exec import distributed
from lmstack.exec.distributed import ParallelRanks, ParallelState
from lmstack.exec.model_runner import ModelRunner
from lmstack.model.source import open_model_source
from lmstack.testing.tiny_model import write_tiny_model


def test_split_points_balance_tokens_and_never_leave_a_part_empty():
    assert split_points([5, 5, 5, 5], 2) == [0, 2, 4]
    assert split_points([1, 1, 1, 30], 2) == [0, 3, 4]
    assert split_points([30, 1, 1, 1], 2) == [0, 1, 4]
    assert split_points([1, 1], 4) == [0, 1, 2]  # fewer sequences than parts
    assert split_points([7], 3) == [0, 1]
    assert split_points([2, 2, 2, 2, 2, 2], 3) == [0, 2, 4, 6]


def test_split_plan_maps_logits_rows_and_keeps_cache_moves_at_the_ends():
    seqs = [SeqPlan([1], 4, [0]), SeqPlan([2], 7, [1]), SeqPlan([3, 4, 5], 0, [2]), SeqPlan([6, 7], 0, [3])]
    # Rows: seq 0 -> 0, seq 1 -> 1, seq 2 -> 2..4, seq 3 -> 5..6; the engine's order is not sorted.
    plan = StepPlan(seqs, logits_indices=[6, 0, 1, 3, 4], blocks_to_copy=[(0, 9)], swap_out=[5])
    a, b = split_plan(plan, 2)
    assert [len(s.token_ids) for s in a.plan.seqs] == [1, 1, 3] and len(b.plan.seqs) == 1
    assert (a.plan.logits_indices, a.rows) == ([0, 1, 3, 4], [1, 2, 3, 4])
    assert (b.plan.logits_indices, b.rows) == ([1], [0])
    assert a.plan.blocks_to_copy == [(0, 9)] and b.plan.blocks_to_copy == []
    assert a.plan.swap_out == [] and b.plan.swap_out == [5]


def _runner(path, ranks: ParallelRanks, monkeypatch) -> ModelRunner:
    # The model build reads this process's place in the layout, as a worker's would.
    monkeypatch.setattr(distributed, "_STATE", ParallelState(ranks))
    source = open_model_source(path)
    attn = TorchAttention()
    runner = ModelRunner(
        source.config,
        source.architecture,
        source.weights(),
        dtype=torch.float32,
        device=torch.device("cpu"),
        quantizer=NoQuantizer(),
        prefill=attn,
        decode=attn,
        kv_cache_dtype=torch.float32,
        max_positions=256,
    )
    runner.init_kv_cache(16, 4)
    return runner


@pytest.mark.parametrize(("tied", "pp"), [(False, 2), (True, 2), (True, 3)])
def test_stage_chain_equals_whole_model(tmp_path, monkeypatch, tied, pp):
    path = write_tiny_model(tmp_path, num_layers=3, tie_word_embeddings=tied)
    whole = _runner(path, ParallelRanks(), monkeypatch)
    stages = [_runner(path, ParallelRanks(pp=pp, rank=r), monkeypatch) for r in range(pp)]

    # Each stage holds only its layers (and KV for them); embedding first, norm + head last.
    held = [
        sorted({n.split(".")[1] for n, _ in s.model.named_parameters() if n.startswith("layers.")})
        for s in stages
    ]
    assert held == ([["0", "1"], ["2"]] if pp == 2 else [["0"], ["1"], ["2"]])
    assert [s.kv_caches[2][0].numel() > 0 for s in stages] == [False] * (pp - 1) + [True]
    names = [{n.split(".")[0] for n, _ in s.model.named_parameters()} for s in stages]
    assert "embed_tokens" in names[0] and all("embed_tokens" not in n for n in names[1:])
    assert "lm_head" in names[-1] and all("lm_head" not in n and "norm" not in n for n in names[:-1])
    if tied:  # the last stage's head was loaded from the embedding tensor
        torch.testing.assert_close(stages[-1].model.lm_head.weight, whole.model.embed_tokens.weight)

    # A prefill of two sequences, then a decode step reading the KV the prefill left in each stage.
    steps = [
        StepPlan(
            [SeqPlan([5, 9, 12, 3, 7], 0, [0, 1]), SeqPlan([4, 4, 8], 0, [2])], logits_indices=[4, 7, 1]
        ),
        StepPlan([SeqPlan([11], 5, [0, 1]), SeqPlan([6], 3, [2])], logits_indices=[0, 1]),
    ]
    for plan in steps:
        expected = whole.execute(plan).logits
        hidden = None
        for s in stages:
            hidden = s.execute(plan, hidden_in=hidden).logits
        assert hidden.shape == expected.shape
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
