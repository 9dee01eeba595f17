"""Engine behaviour on the real model: sampling, stops, n > 1, abort, metrics, bad input,
and the seams later plugins use (multi-token decode queries, per-sequence logits processors,
content-hashed blocks)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lmstack import SamplingParams
from lmstack.errors import InvalidRequestError
from lmstack.hookspecs import hookimpl
from lmstack.interfaces import BlockCache, Speculator
from lmstack.sample.verification import Draft

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


@pytest.fixture
def llm(shared_llm):
    return shared_llm(STACK)


def chat(llm, text):
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=30),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert "<|im_end|>" not in out.text


def test_text_and_token_prompts_agree(llm):
    ids = chat(llm, "Name a color.")
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    p = SamplingParams(temperature=0.0, max_tokens=8)
    a, b = llm.generate([ids, text], p)
    assert a.token_ids == b.token_ids


def test_seeded_sampling_is_batch_invariant(llm):
    target = chat(llm, "Tell me a short story about a cat.")
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(target, p)[0]
    others = [
        chat(llm, q)
        for q in ["Count to ten.", "Write a poem about rain and wind and the autumn sea.", "What is 2 + 2?"]
    ]
    mixed = llm.generate(
        others[:2] + [target] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=30)] * 2
        + [p]
        + [SamplingParams(temperature=0.0, max_tokens=5)],
    )
    assert mixed[2].text == alone.text
    assert mixed[2].token_ids == alone.token_ids
    # and a different seed gives a different sample (the seed is really used)
    other = llm.generate(
        target, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24)
    )[0]
    assert other.token_ids != alone.token_ids


def test_n_samples_share_the_prompt_blocks(llm):
    eng = llm.engine
    prompt = chat(llm, "Give me a random animal name.")
    rid = eng.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))
    shared_seen = False
    final = None
    while final is None:
        for out in eng.step():
            if out.finished:
                final = out
        req = eng.requests.get(rid)
        if req and len(req.seqs) == 3 and not any(s.is_finished for s in req.seqs):
            tables = [eng.allocator.block_table(s) for s in req.seqs]
            shared_seen |= tables[0][0] == tables[1][0] == tables[2][0]
    assert shared_seen, "forks must share the prompt's first block"
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


def test_stop_strings_are_not_leaked(llm):
    prompt = chat(llm, "Count from 1 to 10, separated by commas.")
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0].text
    assert "5" in full
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=["5"]))[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == "5"
    assert cut.text == full[: full.index("5")]


def test_stop_token_ids_min_tokens_ignore_eos(llm):
    prompt = chat(llm, "What is the capital of France?")
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert base.finish_reason == "stop"
    first = base.token_ids[0]
    st = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[first]))[0]
    assert st.token_ids == [first] and st.outputs[0].stop_reason == first
    forced = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=len(base.token_ids) + 3)
    )[0]
    assert len(forced.token_ids) >= len(base.token_ids) + 3
    ign = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert len(ign.token_ids) == 12 and ign.finish_reason == "length"


def test_logprobs_and_penalties(llm):
    prompt = chat(llm, "Repeat the word 'apple' ten times.")
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) > 1
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and lp[tok] <= 0.0
        assert max(lp.values()) == pytest.approx(lp[tok], abs=1e-5)  # greedy: chosen is the top
        assert len(lp) <= 4
    prompt = llm.tokenizer.encode("apple apple apple apple apple")
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].token_ids
    penal = llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
        ),
    )[0].token_ids
    assert penal != plain
    assert max(penal.count(t) for t in set(penal)) <= max(plain.count(t) for t in set(plain))


def test_per_sequence_logits_processor_and_allowed_tokens(llm):
    prompt = chat(llm, "Say something.")
    allowed = llm.tokenizer.encode(" yes no maybe")
    seen_rows = []

    def ban_common(token_ids, logits):
        seen_rows.append(logits.shape)
        logits[allowed] = float("-inf")
        return logits

    a, b, c = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=allowed),
            SamplingParams(temperature=0.0, max_tokens=6),
            SamplingParams(temperature=0.0, max_tokens=6, logits_processors=[ban_common]),
        ],
    )
    assert set(a.token_ids) <= set(allowed)
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert b.token_ids == plain.token_ids, "other sequences in the batch are untouched"
    assert not set(c.token_ids) & set(allowed)
    assert seen_rows and all(s == (llm.engine.model_config.vocab_size,) for s in seen_rows)


def test_abort_frees_blocks_and_others_continue(llm):
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=30)
    keep = eng.add_request(chat(llm, "Describe the moon."), p)
    drop = eng.add_request(chat(llm, "Describe the sun."), p)
    for _ in range(3):
        eng.step()
    assert eng.abort(drop)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[drop].finish_reason == "abort" and outs[drop].finished
    assert outs[keep].finish_reason in ("stop", "length")
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks
    assert not eng.abort("no-such-request")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_prompt_and_max_tokens_past_the_context(llm):
    eng = llm.engine
    limit = eng.max_model_len
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1] * limit, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt" and str(limit) in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1] * 10, SamplingParams(max_tokens=limit))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        eng.add_request([10**9], SamplingParams())
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1, 2], SamplingParams(n=eng.limits.max_num_seqs + 1))
    assert e.value.param == "n"
    # the engine is unharmed
    assert llm.generate(chat(llm, "Hi"), SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids


def test_metrics_snapshot(llm):
    old = llm.get_stats()
    kept = (old.generation_tokens, old.num_steps, old.num_finished, dict(old.finished_by_reason))
    llm.generate(chat(llm, "Hello there"), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    s = llm.get_stats()
    assert s.generation_tokens - old.generation_tokens == 5
    assert s.prompt_tokens > 0 and s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0
    assert s.finished_by_reason.get("length", 0) >= 1
    # A snapshot: the steps since left the earlier one as it was, nested dict included.
    assert (old.generation_tokens, old.num_steps, old.num_finished, old.finished_by_reason) == kept
    s.finished_by_reason["stop"] = 10**6  # and what a caller does to one stays with it
    assert llm.get_stats().finished_by_reason.get("stop", 0) < 10**6


class StatsRecorder:
    """A lifecycle plugin keeping every stats object `lmstack_step_finished` hands it."""

    def __init__(self) -> None:
        self.seen: list = []

    @hookimpl
    def lmstack_step_finished(self, engine, stats) -> None:
        self.seen.append((stats, stats.num_steps, stats.generation_tokens))


def test_step_finished_hook_gets_a_snapshot_per_step(llm):
    recorder = StatsRecorder()
    llm.engine.pm.register(recorder)
    try:
        llm.generate([504, 3575, 282], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        llm.engine.pm.unregister(recorder)
    assert len(recorder.seen) >= 4
    assert len({id(stats) for stats, _, _ in recorder.seen}) == len(recorder.seen)
    # Each kept object still reads what it read during its own step.
    assert all((stats.num_steps, stats.generation_tokens) == (n, g) for stats, n, g in recorder.seen)
    steps = [n for _, n, _ in recorder.seen]
    assert steps == list(range(steps[0], steps[0] + len(steps)))


class RecordingScheduler:
    """Wraps the engine's scheduler and notes the metadata of every request it is handed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seen: list[tuple[str, str | None, str | None]] = []
        self.streamed: list[bool] = []

    def add(self, seq) -> None:
        req = seq.request
        self.seen.append((req.request_id, req.client_request_id, req.tenant))
        self.streamed.append(req.streamed)
        self.inner.add(seq)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_request_metadata_reaches_the_scheduler(llm, monkeypatch):
    rec = RecordingScheduler(llm.engine.scheduler)
    monkeypatch.setattr(llm.engine, "scheduler", rec)
    eng, params, prompt = llm.engine, SamplingParams(max_tokens=1), [504, 3575, 282]
    ids = [
        eng.add_request(prompt, params, tenant="acme", client_request_id="trace-1"),
        eng.add_request(prompt, params, tenant="acme", client_request_id="trace-1"),
        eng.add_request(prompt, params),
    ]
    while eng.has_unfinished():
        eng.step()
    # One caller id twice is two requests with their own engine ids; the plain one has no metadata.
    assert len(set(ids)) == 3
    assert rec.seen == [(ids[0], "trace-1", "acme"), (ids[1], "trace-1", "acme"), (ids[2], None, None)]
    # A request is streamed unless its caller says it reads only the end, as `LLM.generate` does.
    eng.add_request(prompt, params, streamed=False)
    while eng.has_unfinished():
        eng.step()
    llm.generate([prompt], params)
    assert rec.streamed == [True, True, True, False, False]


class ReplayDrafter(Speculator):
    """Proposes the tokens of a known continuation, with every third draft corrupted, so both
    acceptance and rejection paths run."""

    num_draft_tokens = 4
    # The verification seam is under test, not the draft length policy: on the shared engine the
    # policy's cost measurements from earlier tests may rightly say no draft pays on this CPU.
    adaptive = False

    def __init__(self, continuation: list[int], prompt_len: int, vocab: int | None = None):
        self.cont, self.prompt_len = continuation, prompt_len
        self.proposed = 0
        self.vocab = vocab  # set: propose `Draft`s with (uniform) draft probabilities, as a sampler would

    def propose(self, seqs):
        out = {}
        for s in seqs:
            done = s.num_tokens - self.prompt_len
            drafts = list(self.cont[done : done + 4])
            for i in range(2, len(drafts), 3):
                drafts[i] = (drafts[i] + 1) % 1000
            out[s.seq_id] = (
                drafts
                if self.vocab is None
                else Draft(drafts, torch.full((len(drafts), self.vocab), 1 / self.vocab))
            )
            self.proposed += len(drafts)
        return out


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft-probs"])
def test_multi_token_decode_queries_verify_losslessly(llm, with_probs):
    """The verification seam: decode steps with query length > 1 (positions and slots per
    token), truncation of rejected drafts' slots, and identical greedy output — for token-list
    drafts and for `Draft`s carrying the drafter's probabilities."""
    eng = llm.engine
    prompt = chat(llm, "Write two sentences about rivers.")
    p = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    plain = llm.generate(prompt, p)[0].token_ids
    drafter = ReplayDrafter(plain, len(prompt), eng.model_config.vocab_size if with_probs else None)
    old = eng.speculator
    eng.speculator = drafter
    accepted_before = eng.stats.num_accepted_tokens  # the engine is shared: count this run's
    try:
        spec = llm.generate(prompt, p)[0].token_ids
    finally:
        eng.speculator = old
    assert spec == plain
    assert drafter.proposed > 0 and eng.stats.num_accepted_tokens > accepted_before
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


class DictBlockCache(BlockCache):
    def __init__(self):
        self.blocks, self.evicted, self.lookups = {}, [], 0

    def lookup(self, h):
        self.lookups += 1
        return self.blocks.get(h)

    def register(self, h, block):
        self.blocks[h] = block

    def evict(self, h, block):
        self.evicted.append(block)
        self.blocks.pop(h, None)


def test_block_cache_seam_reuses_full_prompt_blocks(llm):
    eng = llm.engine
    cache = DictBlockCache()
    eng.allocator.block_cache = cache
    try:
        prompt = chat(llm, "Explain photosynthesis to a child in three sentences, using simple words.")
        p = SamplingParams(temperature=0.0, max_tokens=10)
        first = llm.generate(prompt, p)[0]
        assert cache.blocks, "full blocks are registered by content hash"
        before = eng.stats.prompt_tokens
        second = llm.generate(prompt, p)[0]
        computed = eng.stats.prompt_tokens - before
        assert second.token_ids == first.token_ids
        assert computed < len(prompt) - 16 + 1, "cached full blocks are not computed again"
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == len(prompt) - computed and second.num_cached_tokens % 16 == 0
    finally:
        eng.allocator.block_cache = None
        eng.allocator._hash_of_block.clear()


def test_async_engine_streams_and_aborts():
    from lmstack.engine.async_engine import AsyncEngine

    async def main(engine: AsyncEngine):
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Count to twenty."}])
        deltas = []
        async for out in await engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12)):
            deltas.append(out.outputs[0].text_delta)
            final = out
        assert final.finished and "".join(deltas) == final.outputs[0].text
        gen = await engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        )
        async for _ in gen:
            break  # client goes away
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.05)
            stats = engine.stats()
            if (
                stats.num_free_kv_blocks == engine.num_kv_blocks
                and stats.num_running + stats.num_waiting == 0
            ):
                break
        stats = engine.stats()
        assert stats.num_free_kv_blocks == engine.num_kv_blocks
        assert stats.num_running == stats.num_waiting == 0
        assert stats.finished_by_reason.get("abort") == 1
        # A snapshot, not the live object: what the caller does to it stays with the caller.
        stats.finished_by_reason.clear()
        assert engine.stats().finished_by_reason.get("abort") == 1

    eng = AsyncEngine({**STACK, "dtype": "bfloat16"})
    try:
        # What the HTTP API reads, without reaching into the engine behind it.
        assert eng.vocab_size == 49152 and eng.num_kv_blocks == 400 and eng.block_size == 16
        assert eng.max_model_len == eng.limits.max_model_len and eng.limits.max_num_seqs == 16
        with pytest.raises(InvalidRequestError) as info:
            eng.make_request([1] * eng.max_model_len)
        assert info.value.param == "prompt"
        assert eng.stats().num_kv_blocks == 400 and eng.stats() is not eng.stats()
        asyncio.run(main(eng))
    finally:
        eng.shutdown()


def test_sampler_rows_do_not_interact():
    from lmstack.sample.sampler import Sampler, SampleRow

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    s = Sampler(50)
    rows = [
        SampleRow(SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.5), [1, 2, 3], 2, 0),
        SampleRow(SamplingParams(temperature=0.0), [4], 1, 0),
        SampleRow(SamplingParams(temperature=1.2, seed=6, top_k=5, min_p=0.1), [7, 8], 1, 0),
    ]
    together = [x.token_id for x in s.sample(logits, rows)]
    alone = [s.sample(logits[i : i + 1], [rows[i]])[0].token_id for i in range(3)]
    assert together == alone
    assert together[1] == int(logits[1].argmax())


def test_failing_logits_processor_ends_only_its_request(llm):
    def broken(token_ids, logits):
        raise ValueError("grammar exploded")

    prompt = chat(llm, "Name a planet.")
    ok, bad = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=6),
            SamplingParams(temperature=0.0, max_tokens=6, logits_processors=[broken]),
        ],
    )
    assert ok.finish_reason in ("stop", "length") and ok.error is None and ok.token_ids
    assert bad.finish_reason == "abort" and "grammar exploded" in bad.error
    assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks
