"""The input processor on its own: tokenization, the chat template, every validation error
(naming its field), stop ids, request ids, and use from many threads at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmstack.engine import input_processor as ip_module
from lmstack.engine.input_processor import InputProcessor
from lmstack.errors import InvalidRequestError
from lmstack.interfaces import EngineLimits
from lmstack.sampling_params import SamplingParams

VOCAB = 64
EOS = frozenset({0})


class CharTokenizer:
    """One token per character (code point mod 60, shifted past the 4 special ids)."""

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 60 for c in text]

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        ids = [1]
        for m in messages:
            ids += [2, *self.encode(m["role"] + ":" + m["content"]), 3]
        return ids + ([2] if add_generation_prompt else [])


@pytest.fixture
def live() -> dict:
    return {}


@pytest.fixture
def proc(live) -> InputProcessor:
    limits = EngineLimits(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64)
    return InputProcessor(CharTokenizer(), VOCAB, limits, EOS, live)


def test_text_and_token_prompts(proc):
    req = proc.make_request("hello", SamplingParams(max_tokens=3))
    assert req.prompt == "hello" and req.prompt_token_ids == CharTokenizer().encode("hello")
    ids = proc.make_request([5, 6, 7])
    assert ids.prompt is None and ids.prompt_token_ids == [5, 6, 7]
    assert ids.params == SamplingParams(), "default parameters when none are given"


def test_chat_template(proc):
    msgs = [{"role": "user", "content": "hi"}]
    assert proc.render_chat(msgs) == CharTokenizer().encode_chat(msgs)
    assert proc.render_chat(msgs, add_generation_prompt=False)[-1] == 3


@pytest.mark.parametrize(
    ("prompt", "params", "param", "words"),
    [
        ("", SamplingParams(), "prompt", "must not be empty"),
        ([], SamplingParams(), "prompt", "must not be empty"),
        ([1, VOCAB], SamplingParams(), "prompt", f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
        ([1, -1], SamplingParams(), "prompt", "outside the vocabulary"),
        ([1, "x"], SamplingParams(), "prompt", "'x' is outside"),
        ([1] * 32, SamplingParams(), "prompt", "prompt has 32 tokens; this model's context is 32 tokens"),
        ([1] * 30, SamplingParams(max_tokens=3), "max_tokens", "lower max_tokens to at most 2"),
        ([1], SamplingParams(n=5), "n", "n=5 exceeds the scheduler's max_num_seqs (4)"),
    ],
)
def test_invalid_requests_name_the_field(proc, prompt, params, param, words):
    with pytest.raises(InvalidRequestError) as info:
        proc.make_request(prompt, params)
    assert info.value.param == param and words in str(info.value)


def test_grammar_for_another_model_is_refused(proc):
    class OtherModelsGrammar:
        vocab_size = VOCAB + 1

    params = SamplingParams()
    params.grammar = OtherModelsGrammar()  # past SamplingParams' own type check: only the size differs
    with pytest.raises(InvalidRequestError, match="compiled for another model") as info:
        proc.make_request([1], params)
    assert info.value.param == "grammar"


def test_stop_ids_and_arrival(proc):
    req = proc.make_request([1], SamplingParams(stop_token_ids=[7]), priority=3, arrival_time=12.5)
    assert req.stop_ids == {0, 7} and req.priority == 3 and req.arrival_time == 12.5
    ignoring = proc.make_request([1], SamplingParams(ignore_eos=True, stop_token_ids=[7]))
    assert ignoring.stop_ids == {7}


def test_request_ids_are_fresh_and_checked_against_live_requests(proc, live):
    a, b = proc.make_request([1]), proc.make_request([1])
    assert a.request_id != b.request_id
    live["mine"] = object()
    with pytest.raises(InvalidRequestError, match="'mine' is already in use") as info:
        proc.make_request([1], request_id="mine")
    assert info.value.param == "request_id"
    assert proc.make_request([1], request_id="other").request_id == "other"


def test_many_threads_get_distinct_ids(proc):
    with ThreadPoolExecutor(8) as pool:
        reqs = list(pool.map(lambda i: proc.make_request(f"prompt {i}"), range(400)))
    assert len({r.request_id for r in reqs}) == 400
    assert all(r.prompt_token_ids == CharTokenizer().encode(r.prompt) for r in reqs)


def test_grammar_compiler_is_built_once_under_races(proc, monkeypatch):
    built = []

    class SlowCompiler:
        def __init__(self, tokenizer, vocab_size, stop_ids):
            time.sleep(0.05)  # wide window for a second thread to race in
            built.append((vocab_size, frozenset(stop_ids)))

    monkeypatch.setattr(ip_module, "GrammarCompiler", SlowCompiler)
    start = threading.Barrier(6)

    def get():
        start.wait()
        return proc.grammar_compiler

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda _: get(), range(6)))
    assert len(built) == 1 and built[0] == (VOCAB, EOS)
    assert all(g is got[0] for g in got)
