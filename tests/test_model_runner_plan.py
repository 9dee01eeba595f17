"""Step plans: how the engine lays a step out (decodes first, logits rows for sampling, drafts
and prompt logprobs) and how the model runner turns a plan into tensors (positions, slot
mapping, block tables) and runs it — checked against transformers on a tiny random Llama,
hidden states included."""

from __future__ import annotations

import pickle

import pytest
import torch

from lmstack.batch import SeqPlan, StepPlan
from lmstack.components.none_quantizer import NoQuantizer
from lmstack.components.torch_attention import TorchAttention
from lmstack.engine.planner import plan_step
from lmstack.exec.model_runner import ModelRunner
from lmstack.interfaces import ScheduledSeq
from lmstack.model.source import open_model_source
from lmstack.sampling_params import SamplingParams
from lmstack.testing.fakes import make_seq

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our runner over the same weights, with a KV cache of 32 blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    source = open_model_source(folder)
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
    runner.init_kv_cache(32, BLOCK)
    return hf, runner


# --- the runner: plan -> tensors ---------------------------------------------------------------


def test_prepare_builds_positions_slots_and_block_tables(tiny):
    _, runner = tiny
    plan = StepPlan(
        [
            SeqPlan([7], context_len=5, block_table=[9, 3]),  # decode at position 5
            SeqPlan([1, 2, 3], context_len=2, block_table=[4, 11]),  # chunk at positions 2..4
        ],
        logits_indices=[0, 3],
        blocks_to_copy=[(3, 8)],
        hidden_state_layers=(1,),
    )
    inp = runner.prepare(plan)
    assert inp.input_ids.tolist() == [7, 1, 2, 3]
    assert inp.positions.tolist() == [5, 2, 3, 4]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert inp.attn.slot_mapping.tolist() == [3 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 11 * 4 + 0]
    assert inp.attn.block_tables.tolist() == [[9, 3], [4, 11]]
    assert inp.attn.query_start_loc.tolist() == [0, 1, 4]
    assert inp.attn.context_lens_cpu == [5, 2] and inp.attn.seq_lens_cpu == [6, 5]
    assert inp.attn.num_decode_seqs == 1
    assert inp.logits_indices.tolist() == [0, 3]
    assert inp.hidden_state_layers == (1,) and inp.blocks_to_copy == [(3, 8)]


def test_swap_out_and_swap_in_move_a_blocks_kv(tiny):
    """What a cache's lower tier relies on: blocks copied out after a step and written into
    other blocks before a later one give the same attention context."""
    _, runner = tiny
    prefill = runner.execute(StepPlan([SeqPlan(list(range(1, 9)), 0, [5, 6])], [7], swap_out=[5, 6]))
    out = prefill.swapped_out
    assert [tuple(t.shape) for t in out] == [(2, 2, BLOCK, 2, 16)] * 2  # layers, K/V, slots, heads, dim
    k_cache, v_cache = runner.kv_caches[1]
    assert torch.equal(out[1][1, 0], k_cache[6]) and torch.equal(out[1][1, 1], v_cache[6])
    here = runner.execute(StepPlan([SeqPlan([9], 8, [5, 6, 7])], [0]))
    moved = runner.execute(StepPlan([SeqPlan([9], 8, [9, 10, 11])], [0], swap_in=[(9, out[0]), (10, out[1])]))
    torch.testing.assert_close(moved.logits, here.logits)


def test_plan_is_plain_data():
    plan = StepPlan([SeqPlan([1, 2], 0, [0])], [1], hidden_state_layers=(0,))
    assert pickle.loads(pickle.dumps(plan)) == plan
    flat = repr(plan)
    assert "tensor" not in flat.lower()


def test_planned_steps_match_a_full_forward_with_hidden_states(tiny):
    """Two sequences over scattered blocks: A prefills in two chunks and then decodes, B
    prefills in one go alongside A's second chunk. Logits at every requested row, and the
    hidden states of layer 0 and after the final norm, match transformers' full forward."""
    hf, runner = tiny
    n_layers = hf.config.num_hidden_layers
    a = [(i * 7 + 3) % 96 for i in range(14)]
    b = [(i * 5 + 1) % 96 for i in range(9)]
    table_a, table_b = [17, 2, 30, 5], [11, 8, 23]
    with torch.no_grad():
        ref_a = hf(torch.tensor([a]), output_hidden_states=True)
        ref_b = hf(torch.tensor([b]), output_hidden_states=True)
    layers = (0, n_layers)

    def check(out, rows, refs):
        for r, (ref, pos) in enumerate(zip(refs, rows, strict=True)):
            torch.testing.assert_close(out.logits[r], ref.logits[0, pos], atol=1e-4, rtol=1e-4)
            # transformers: hidden_states[1] = decoder layer 0's output, [-1] = after the norm.
            torch.testing.assert_close(
                out.hidden_states[0][r], ref.hidden_states[1][0, pos], atol=1e-4, rtol=1e-4
            )
            torch.testing.assert_close(
                out.hidden_states[n_layers][r], ref.hidden_states[-1][0, pos], atol=1e-4, rtol=1e-4
            )

    # Step 1: A's first 6 tokens (crosses a block boundary); every row back.
    out = runner.execute(StepPlan([SeqPlan(a[:6], 0, table_a)], list(range(6)), hidden_state_layers=layers))
    check(out, range(6), [ref_a] * 6)
    # Step 2: A's remaining 7 prompt tokens but one, then B whole; A's last row, B's rows 0 and 8.
    out = runner.execute(
        StepPlan(
            [SeqPlan(a[6:13], 6, table_a), SeqPlan(b, 0, table_b)],
            logits_indices=[6, 7, 15],
            hidden_state_layers=layers,
        )
    )
    check(out, [12, 0, 8], [ref_a, ref_b, ref_b])
    # Step 3: a decode for A (its 14th token, reading 13 cached ones), first in the batch.
    out = runner.execute(StepPlan([SeqPlan(a[13:], 13, table_a)], [0], hidden_state_layers=layers))
    check(out, [13], [ref_a])
    assert set(out.hidden_states) == set(layers)


def test_no_hidden_states_unless_asked(tiny):
    _, runner = tiny
    out = runner.execute(StepPlan([SeqPlan([1, 2, 3], 0, [0])], [2]))
    assert out.hidden_states == {} and out.logits.shape == (1, 96)


# --- the planner: scheduler output -> plan and logits rows -----------------------------------


def _tables(seq) -> list[int]:
    return [100 + seq.seq_id, 200 + seq.seq_id]


def test_plan_puts_decodes_first_and_maps_logits_rows():
    prefill = make_seq(10)  # chunk 0..5: does not reach its newest token, no sampling
    decode = make_seq(6)
    decode.num_computed_tokens = 5
    drafted = make_seq(4)
    drafted.token_ids.append(50)
    drafted.num_computed_tokens = 4
    drafted.draft_token_ids = [61, 62]
    planned = plan_step(
        [ScheduledSeq(prefill, 6), ScheduledSeq(drafted, 3), ScheduledSeq(decode, 1)],
        [(1, 2)],
        _tables,
        hidden_state_layers=(3,),
    )
    plan = planned.plan
    assert [len(s.token_ids) for s in plan.seqs] == [1, 6, 3], "decodes first, then in scheduler order"
    assert plan.seqs[0] == SeqPlan([decode.token_ids[5]], 5, _tables(decode))
    assert plan.seqs[1] == SeqPlan(prefill.token_ids[:6], 0, _tables(prefill))
    assert plan.seqs[2] == SeqPlan([50, 61, 62], 4, _tables(drafted))
    assert plan.blocks_to_copy == [(1, 2)] and plan.hidden_state_layers == (3,)
    # decode: batch row 0; drafted: rows 7, 8, 9 (newest token + two drafts); prefill: none.
    assert plan.logits_indices == [0, 7, 8, 9]
    assert [(r.seq, r.logits_index, r.drafts) for r in planned.samples] == [
        (decode, 0, []),
        (drafted, 1, [61, 62]),
    ]
    assert planned.prompt_logprobs == []


def test_plan_drops_drafts_a_chunk_cannot_reach():
    seq = make_seq(8)
    seq.num_computed_tokens = 2
    seq.draft_token_ids = [5, 6]
    planned = plan_step([ScheduledSeq(seq, 3)], [], _tables)
    assert planned.samples == [] and seq.draft_token_ids == []


def test_plan_rows_for_prompt_logprobs_across_chunks():
    seq = make_seq(7)
    seq.request.params = SamplingParams(prompt_logprobs=1, max_tokens=4)
    first = plan_step([ScheduledSeq(seq, 4)], [], _tables)
    # Rows at positions 0..3 predict prompt tokens 1..4; the chunk does not sample.
    (rows,) = first.prompt_logprobs
    assert (rows.logits_index, rows.position, rows.count) == (0, 0, 4)
    assert first.plan.logits_indices == [0, 1, 2, 3] and first.samples == []
    seq.request.prompt_logprobs = [None, {}, {}, {}, {}]  # what the output processor recorded
    seq.num_computed_tokens = 4
    second = plan_step([ScheduledSeq(seq, 3)], [], _tables)
    (rows,) = second.prompt_logprobs
    # Positions 4, 5 predict tokens 5, 6; position 6 (the last prompt token) samples instead.
    assert (rows.logits_index, rows.position, rows.count) == (0, 4, 2)
    assert second.plan.logits_indices == [0, 1, 2]
    assert [(r.logits_index, r.drafts) for r in second.samples] == [(2, [])]
