"""The output processor on its own (real SmolLM2 tokenizer, no model): stop reasons, stop
strings and the text held back while one may be forming, logprobs, deltas, prompt logprobs,
and the fields of `RequestOutput`."""

from __future__ import annotations

import pytest
import torch

from lmstack.engine.output_processor import OutputProcessor, holdback
from lmstack.model.source import open_model_source
from lmstack.sample.sampler import Sampled
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import FinishReason, Request, Sequence, SequenceStatus

MAX_LEN = 64


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return open_model_source(str(smollm2_path)).tokenizer


@pytest.fixture
def proc(tok) -> OutputProcessor:
    return OutputProcessor(tok, frozenset(tok.eos_token_ids), MAX_LEN)


def _seq(proc: OutputProcessor, tok, params: SamplingParams, prompt: str = "Say something:") -> Sequence:
    req = Request("r", tok.encode(prompt), params)
    seq = Sequence(0, req, list(req.prompt_token_ids))
    seq.status = SequenceStatus.RUNNING
    req.seqs.append(seq)
    proc.add(seq)
    return seq


def _feed(proc: OutputProcessor, seq: Sequence, ids: list[int]) -> FinishReason | None:
    """One token per step, as decoding appends them; the finish reason once one stops it."""
    for t in ids:
        reason = proc.append(seq, [Sampled(t, -0.5)])
        if reason is not None:
            proc.finish(seq, reason)
            return reason
    return None


def test_holdback():
    assert holdback("Hello wo", ["world"]) == 2
    assert holdback("Hello w", ["xyz", "wor"]) == 1
    assert holdback("Hello", ["world"]) == 0
    assert holdback("ab", ["abc", "b!"]) == 2


def test_stop_string_cuts_the_text_and_streams_nothing_of_it(proc, tok):
    seq = _seq(proc, tok, SamplingParams(stop=["world"], max_tokens=30))
    ids = tok.encode(" Hello brave new world and more")
    streamed = []
    for t in ids:
        reason = proc.append(seq, [Sampled(t, 0.0)])
        if reason is not None:
            proc.finish(seq, reason)
        out = proc.make_output(seq.request)
        streamed.append(out.outputs[0].text_delta)
        # Nothing of the stop string ever reaches the client, not even its first letters.
        assert "w" not in out.outputs[0].text.replace("new", "")
        if reason is not None:
            break
    assert reason is FinishReason.STOP and seq.stop_reason == "world"
    assert seq.output_text == " Hello brave new "
    assert "".join(streamed) == " Hello brave new "
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "world"


def test_eos_stops_unless_ignored_or_too_early(proc, tok):
    eos = tok.eos_token_ids[0]
    word = tok.encode(" yes")[0]
    seq = _seq(proc, tok, SamplingParams(max_tokens=10))
    assert _feed(proc, seq, [word, eos, word]) is FinishReason.STOP
    assert seq.output_token_ids == [word, eos], "tokens after the stop are dropped"
    assert seq.stop_reason is None and seq.output_text == " yes"

    early = _seq(proc, tok, SamplingParams(max_tokens=10, min_tokens=3))
    assert _feed(proc, early, [eos, word, eos]) is FinishReason.STOP
    assert early.num_output_tokens == 3

    ignoring = _seq(proc, tok, SamplingParams(max_tokens=4, ignore_eos=True))
    assert _feed(proc, ignoring, [eos, eos, eos, eos]) is FinishReason.LENGTH


def test_stop_token_ids_name_the_token(proc, tok):
    a, b = tok.encode(" a b")
    seq = _seq(proc, tok, SamplingParams(max_tokens=10, stop_token_ids=[b]))
    assert _feed(proc, seq, [a, a, b]) is FinishReason.STOP
    assert seq.stop_reason == b


def test_length_by_max_tokens_and_by_context(proc, tok):
    word = tok.encode(" go")[0]
    seq = _seq(proc, tok, SamplingParams(max_tokens=3))
    assert _feed(proc, seq, [word] * 5) is FinishReason.LENGTH and seq.num_output_tokens == 3
    unbounded = _seq(proc, tok, SamplingParams(max_tokens=None))  # the context is the limit
    assert proc.max_tokens(unbounded) == MAX_LEN - unbounded.prompt_len
    assert proc.room(unbounded) == MAX_LEN - unbounded.prompt_len
    assert _feed(proc, unbounded, [word] * MAX_LEN) is FinishReason.LENGTH
    assert unbounded.num_tokens == MAX_LEN


def test_logprobs_and_deltas(proc, tok):
    ids = tok.encode(" one two three")
    seq = _seq(proc, tok, SamplingParams(max_tokens=10, logprobs=1))
    proc.append(seq, [Sampled(ids[0], -0.25, {ids[0]: -0.25, 7: -2.0})])
    first = proc.make_output(seq.request).outputs[0]
    assert first.token_ids_delta == ids[:1] and first.logprobs == [{ids[0]: -0.25, 7: -2.0}]
    proc.append(seq, [Sampled(t, -1.0) for t in ids[1:]])  # several at once, as after verification
    second = proc.make_output(seq.request).outputs[0]
    assert second.token_ids_delta == ids[1:] and second.token_ids == ids
    assert first.text_delta + second.text_delta == " one two three" == second.text
    assert second.cumulative_logprob == pytest.approx(-0.25 - (len(ids) - 1))
    assert proc.make_output(seq.request).outputs[0].text_delta == "", "nothing new, nothing sent"


def test_no_logprobs_unless_asked(proc, tok):
    seq = _seq(proc, tok, SamplingParams(max_tokens=10))
    proc.append(seq, [Sampled(tok.encode(" hi")[0], -0.5)])
    out = proc.make_output(seq.request).outputs[0]
    assert out.logprobs is None and seq.cumulative_logprob == 0.0


def test_prompt_logprobs_from_rows(proc, tok):
    seq = _seq(proc, tok, SamplingParams(max_tokens=2, prompt_logprobs=1))
    req = seq.request
    vocab = tok.vocab_size
    logits = torch.zeros(2, vocab)
    target = req.prompt_token_ids[1]
    logits[0, target] = 3.0  # row 0 predicts prompt token 1
    logits[1, 5] = 2.0
    proc.record_prompt_logprobs(req, logits, 0)
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == 3
    expected = float(torch.log_softmax(logits[0], -1)[target])
    assert req.prompt_logprobs[1] == pytest.approx({target: expected})
    second = req.prompt_logprobs[2]
    assert 5 in second and req.prompt_token_ids[2] in second
    assert proc.make_output(req).prompt_logprobs == req.prompt_logprobs


def test_output_fields(proc, tok):
    seq = _seq(proc, tok, SamplingParams(max_tokens=1))
    req = seq.request
    req.num_cached_tokens = 16
    req.first_scheduled_time = req.arrival_time + 1.0
    _feed(proc, seq, tok.encode(" ok"))
    out = proc.make_output(req)
    assert out.request_id == "r" and out.prompt_token_ids == req.prompt_token_ids
    assert out.num_cached_tokens == 16 and out.finished and out.finish_reason == "length"
    assert out.metrics.first_scheduled_time == req.first_scheduled_time
    proc.release(req)
    again = proc.make_output(req)  # after release, a finished request still renders
    assert again.text == out.text and again.outputs[0].text_delta == out.text
