"""Structured output (xgrammar): the per-sequence grammar mask, schema compilation and its cache,
and end-to-end JSON generation on the real model, alone, beside plain requests, with n > 1 and
with speculative drafts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lmstack import SamplingParams
from lmstack.errors import InvalidRequestError
from lmstack.interfaces import Speculator
from lmstack.sample.grammar import GrammarCompiler, GrammarError

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "float32",
    "scheduler": {"name": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 128},
    "allocator": {"name": "paged", "block_size": 16, "num_blocks": 400},
    # The dequantized checkpoint through the reference kernels, without prefix caching: what
    # this test was written against, not the defaults' autos (GGUF blocks, cpu-paged, prefix).
    "quant": {"weights": "none"},
    "attention": "torch",
    "cache": "none",
}

INT_A = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}

# Small enough for a 135M model to finish: an enum, a bounded integer, a bounded string.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture
def llm(shared_llm):
    return shared_llm(STACK)


def chat(llm, text):
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def allowed(state, output_ids, vocab):
    logits = torch.zeros(vocab)
    state.apply(logits, output_ids)
    return set(torch.nonzero(logits == 0).flatten().tolist())


# --- the mask --------------------------------------------------------------------------------


def test_mask_allows_only_what_the_grammar_allows(llm):
    eng = llm.engine
    vocab, pieces = eng.model_config.vocab_size, llm.tokenizer.byte_pieces
    g = eng.grammar_compiler.json_schema(INT_A)
    state = g.new_state()
    first = allowed(state, [], vocab)
    assert first and all(pieces[t].startswith(b"{") for t in first)
    assert not (first & eng.eos_token_ids), "the end token waits until the JSON is complete"

    ids = llm.tokenizer.encode('{"a": 12}')
    assert allowed(state, ids, vocab) == set(eng.eos_token_ids), "complete: only the end token remains"
    fresh = g.new_state()  # a fresh state fed the whole list at once agrees with one fed stepwise
    assert allowed(fresh, ids, vocab) == set(eng.eos_token_ids)
    # after the end token (ignore_eos keeps going): only end tokens, nothing else is accepted
    eos = min(eng.eos_token_ids)
    assert allowed(fresh, [*ids, eos, eos], vocab) == set(eng.eos_token_ids)
    with pytest.raises(GrammarError):
        fresh.apply(torch.zeros(vocab), [*ids, eos, ids[0]])

    bad = llm.tokenizer.encode("hello")[0]
    with pytest.raises(GrammarError):  # a ValueError
        g.new_state().apply(torch.zeros(vocab), [bad])
    with pytest.raises(ValueError):
        g.new_state().apply(torch.zeros(vocab), ids[:2] + [bad])


def test_state_rolls_back_and_rebuilds(llm):
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    g = eng.grammar_compiler.json_schema(INT_A)
    a = llm.tokenizer.encode('{"a": 123}')
    b = llm.tokenizer.encode('{"a": -7}')
    assert a[:3] == b[:3] and a[3] != b[3]  # " " vs " -"
    state = g.new_state()
    allowed(state, a, vocab)
    # shorter (rejected drafts), then longer and divergent (a different continuation)
    for ids in (a[:3], b, a[:5], a + [2], b[:1], a):
        assert allowed(state, ids, vocab) == allowed(g.new_state(), ids, vocab), ids
    # an invalid token leaves the state usable at the longest accepted prefix
    with pytest.raises(GrammarError):
        state.apply(torch.zeros(vocab), a[:3] + [llm.tokenizer.encode("x")[0]])
    assert allowed(state, a[:3], vocab) == allowed(g.new_state(), a[:3], vocab)


def test_mask_follows_the_logits_device_and_leaves_other_rows(llm):
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    state = eng.grammar_compiler.json_schema(INT_A).new_state()
    batch = torch.randn(3, vocab)
    before = batch.clone()
    state.apply(batch[1], [])  # in place on one row of a batch
    assert torch.equal(batch[0], before[0]) and torch.equal(batch[2], before[2])
    assert torch.isinf(batch[1]).sum() == vocab - len(allowed(state, [], vocab))


# --- compilation ----------------------------------------------------------------------------


def test_same_schema_compiles_once(llm):
    gc = llm.engine.grammar_compiler
    assert gc is llm.engine.grammar_compiler
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    before = gc.cache_info()
    g1 = gc.json_schema(schema)
    g2 = gc.json_schema(json.dumps(schema, indent=4))  # the same schema as spaced-out text
    g3 = llm.json_schema(dict(schema))
    after = gc.cache_info()
    assert g1 is g2 is g3
    assert after.misses - before.misses == 1 and after.hits - before.hits == 2
    assert gc.json_schema(schema, strict=False) is not g1  # a different grammar
    assert gc.json_object() is gc.json_object()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "not-a-type"},
        '{"type": "object", ',  # not JSON
        [1, 2],  # not an object
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    ],
)
def test_invalid_schema_is_a_request_error(llm, schema):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.grammar_compiler.json_schema(schema)
    assert e.value.param == "response_format.json_schema.schema"
    assert "\n" not in str(e.value) and ".cc:" not in str(e.value)


def test_grammar_must_be_compiled():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(grammar={"type": "object"})
    assert e.value.param == "grammar"


def test_without_xgrammar(llm, monkeypatch):
    """The core imports without xgrammar; asking for structured output then says what to install."""
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "import lmstack, lmstack.engine.llm_engine, lmstack.engine.llm, lmstack.sample.grammar, lmstack.sample.sampler\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(llm.engine.input_processor, "_grammar_compiler", None)
    with pytest.raises(InvalidRequestError, match="pip install xgrammar") as e:
        llm.engine.grammar_compiler  # noqa: B018
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, [2])


# --- end to end -----------------------------------------------------------------------------


def test_json_request_beside_plain_requests(llm):
    g = llm.json_schema(PERSON)
    plain_prompts = [chat(llm, "What is 2 + 2?"), chat(llm, "Name a fruit.")]
    plain_p = SamplingParams(temperature=0.0, max_tokens=20)
    alone = llm.generate(plain_prompts, plain_p)
    json_p = SamplingParams(temperature=1.0, seed=3, max_tokens=120, grammar=g)
    mixed = llm.generate(
        [
            plain_prompts[0],
            chat(llm, "Describe a person as JSON: name, age, favourite color."),
            plain_prompts[1],
        ],
        [plain_p, json_p, plain_p],
    )
    out = mixed[1]
    assert out.error is None and out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)
    # the mask is per sequence: the plain requests are exactly what they were without it
    assert [o.token_ids for o in (mixed[0], mixed[2])] == [o.token_ids for o in alone]
    assert [o.text for o in (mixed[0], mixed[2])] == [o.text for o in alone]


def test_n_samples_each_follow_the_schema(llm):
    g = llm.json_schema(PERSON)
    out = llm.generate(
        chat(llm, "Describe a person as JSON."),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=120, grammar=g),
    )[0]
    assert len(out.outputs) == 2 and out.error is None
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert out.outputs[0].text != out.outputs[1].text


def test_json_object(llm):
    g = llm.engine.grammar_compiler.json_object()
    out = llm.generate(
        chat(llm, "Reply with a JSON object with keys city and country for Paris."),
        SamplingParams(temperature=0.0, max_tokens=80, grammar=g),
    )[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


class CorruptingDrafter(Speculator):
    """Drafts a known continuation with every other draft corrupted (rejections, rollbacks)."""

    num_draft_tokens = 3
    adaptive = False  # drafts on every step, whatever the policy would measure on this CPU

    def __init__(self, continuation: list[int], prompt_len: int):
        self.cont, self.prompt_len, self.proposed = continuation, prompt_len, 0

    def propose(self, seqs):
        out = {}
        for s in seqs:
            drafts = list(self.cont[s.num_tokens - self.prompt_len :][:3])
            for i in range(1, len(drafts), 2):
                drafts[i] = (drafts[i] + 1) % 1000
            out[s.seq_id] = drafts
            self.proposed += len(drafts)
        return out


def test_speculative_drafts_are_checked_against_the_grammar(llm):
    """Drafts go through the grammar mask during verification; rejected ones roll the state back, and
    greedy output is the same as without drafts."""
    eng = llm.engine
    prompt = chat(llm, "Describe a person as JSON.")
    p = SamplingParams(temperature=0.0, max_tokens=60, grammar=llm.json_schema(PERSON))
    plain = llm.generate(prompt, p)[0]
    assert plain.finish_reason == "stop"
    drafter = CorruptingDrafter(plain.token_ids, len(prompt))
    old, eng.speculator = eng.speculator, drafter
    try:
        spec = llm.generate(prompt, p)[0]
    finally:
        eng.speculator = old
    assert spec.error is None and spec.token_ids == plain.token_ids
    assert drafter.proposed > 0
    jsonschema.validate(json.loads(spec.text), PERSON)
