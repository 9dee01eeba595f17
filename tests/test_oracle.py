"""Our engine against Hugging Face transformers on the same GGUF weights.

fp32: greedy tokens must be identical, for 8 prompts of different lengths run together under
continuous batching — with chunked prefill, with a KV budget small enough to force preemption,
and with requests arriving while others run. bf16: teacher-forced logits no worse than
transformers' own bf16 model's, measured in the same test.
"""

from __future__ import annotations

import pytest
import torch

from lmstack import SamplingParams
from lmstack.batch import SeqPlan, StepPlan
from lmstack.engine.llm_engine import LLMEngine
from lmstack.testing import make_seq

# Raw-text prompts stay shorter than one block; the chat template's system prompt alone is longer.
RAW = ["The capital of France is", "1, 2, 3, 4,"]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning' into Spanish and German.",
    "Summarise this text in one sentence: "
    + " ".join(
        f"Paragraph {i}: the committee met again to discuss the budget, the roads and the schools."
        for i in range(8)
    ),
]
MAX_NEW = 20


def _stack(dtype="float32", **over):
    stack = {
        "model": "smollm2-135m-instruct",
        "dtype": dtype,
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 64},
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
        # The dequantized checkpoint through the reference kernels, as transformers computes it,
        # not the defaults' autos (GGUF blocks with int8 activations, cpu-paged, prefix caching).
        "quant": {"weights": "none"},
        "attention": {"prefill": {"name": "torch"}, "decode": {"name": "torch"}},
        "cache": {"name": "none"},
    }
    for k, v in over.items():
        stack[k] = {**stack.get(k, {}), **v}
    return stack


@pytest.fixture(scope="module")
def prompts(hf_smollm2):
    _, tok = hf_smollm2
    out = [tok.encode(t, add_special_tokens=False) for t in RAW]
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, prompts):
    model, _ = hf_smollm2
    result = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            result.append(out[0, len(ids) :].tolist())
    return result


# The attention backends the oracle runs under: the torch reference and, where installed and
# buildable on this machine, the C++ kernels of plugins/attention/cpu-paged.
ATTENTION = ["torch", "cpu-paged"]


def _attention(name: str) -> dict:
    """The stack's attention section for `name`; skips when that backend is unavailable here."""
    if name == "torch":
        return {}
    from lmstack.stack.plugins import default_registry

    if name not in default_registry().names("attention"):
        pytest.skip(f"the {name!r} attention plugin is not installed")
    if name == "cpu-paged":
        from lmstack_cpu_paged.build import load_error

        if (problem := load_error()) is not None:
            pytest.skip(f"cpu-paged cannot be built here: {problem}")
    return {"attention": {"prefill": {"name": name}, "decode": {"name": name}}}


@pytest.fixture(params=ATTENTION)
def attention(request) -> dict:
    return _attention(request.param)


@pytest.fixture
def engine_fp32(shared_llm):
    return shared_llm(_stack()).engine


# The KV budget and token budget of `engine_tight`.
TIGHT = {"allocator": {"num_blocks": 14}, "scheduler": {"max_num_batched_tokens": 256}}


@pytest.fixture
def engine_tight(shared_llm):
    """14 blocks of 16 tokens: the 8 prompts (~40-150 tokens + 20 new) cannot all fit at once."""
    return shared_llm(_stack(**TIGHT)).engine


def _run(engine: LLMEngine, prompts, arrivals: dict[int, list[int]] | None = None):
    """Greedy-generate; prompts listed in `arrivals[step]` are added at that step."""
    arrivals = arrivals or {0: list(range(len(prompts)))}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    while len(results) < len(prompts):
        for i in arrivals.get(step, []):
            ids[engine.add_request(prompts[i], params)] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
        assert step < 5000
    return [results[i] for i in range(len(prompts))]


def test_prompts_cover_the_interesting_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 16 < lengths[-1], "some prompts shorter and some longer than a block"
    assert lengths[-1] > 64, "one prompt longer than the prefill chunk (token budget 64)"


def test_greedy_equals_transformers_with_chunked_prefill(shared_llm, attention, prompts, hf_greedy):
    engine = shared_llm(_stack(**attention)).engine
    assert _run(engine, prompts) == hf_greedy
    stats = engine.get_stats()
    assert stats.kv_usage == 0.0 and stats.num_running == 0


def test_greedy_equals_transformers_with_arrivals_during_decode(engine_fp32, prompts, hf_greedy):
    arrivals = {0: [0, 1, 2], 3: [3, 4], 7: [5, 6], 12: [7]}
    assert _run(engine_fp32, prompts, arrivals) == hf_greedy


def test_greedy_equals_transformers_under_preemption(shared_llm, attention, prompts, hf_greedy):
    engine_tight = shared_llm(_stack(**TIGHT, **attention)).engine
    before = engine_tight.get_stats().num_preemptions  # the engine is shared: count this run's
    assert _run(engine_tight, prompts) == hf_greedy
    stats = engine_tight.get_stats()
    assert stats.num_preemptions > before, "the KV budget was meant to force preemption"
    assert stats.kv_usage == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["prefix", "tiered"])
def test_greedy_equals_transformers_with_a_prefix_cache(
    shared_llm, prompts, hf_greedy, cache, tmp_path_factory
):
    """The oracle prompts twice through a cache under a tight pool (preemption, eviction; the
    tiered cache loads evicted blocks back from disk) and a 24-token budget (prompts are
    prefilled in chunks, the second pass starting at the cached boundary): the second pass is
    served partly from the cache and still equals transformers."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    if cache not in build_registry(make_plugin_manager()).names("cache"):
        pytest.skip(f"the {cache!r} cache plugin is not installed")
    assert max(map(len, prompts)) > 24, "the prompts were meant to be prefilled in chunks"
    section = {"name": cache}
    if cache == "tiered":
        section["disk_path"] = str(tmp_path_factory.mktemp("oracle-kv"))
    engine = shared_llm(
        _stack(allocator={"num_blocks": 14}, scheduler={"max_num_batched_tokens": 24}, cache=section)
    ).engine
    assert _run(engine, prompts) == hf_greedy
    hits = []
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)) for p in prompts]
    results = {}
    while len(results) < len(prompts):
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
                hits.append(out.num_cached_tokens)
    assert [results[i] for i in ids] == hf_greedy
    assert sum(hits) > 0, "the second pass was meant to hit the cache"


def _forward_all(engine: LLMEngine, token_ids: list[int], layers: tuple[int, ...] = ()):
    """Teacher-forced forward through the engine's runner: logits (and hidden states) for
    every position, not just the last — the seam verification and prompt logprobs use."""
    seq = make_seq(len(token_ids))
    seq.token_ids = list(token_ids)
    engine.allocator.allocate(seq, len(token_ids))
    try:
        n = len(token_ids)
        plan = StepPlan(
            [SeqPlan(list(token_ids), 0, engine.allocator.block_table(seq))],
            logits_indices=list(range(n)),
            hidden_state_layers=layers,
        )
        out = engine.executor.execute(plan)
    finally:
        engine.allocator.free(seq)
    return out


def test_all_position_logits_and_hidden_states_match_fp32(engine_fp32, hf_smollm2, prompts):
    model, _ = hf_smollm2
    ids = prompts[6][:100]
    ours = _forward_all(engine_fp32, ids, layers=(0, 14, 29))
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert ours.logits.shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(ours.logits, ref.logits[0].float(), atol=2e-3, rtol=1e-3)
    for layer in (0, 14):  # HF hidden_states[i + 1] is decoder layer i's output
        torch.testing.assert_close(
            ours.hidden_states[layer], ref.hidden_states[layer + 1][0], atol=2e-3, rtol=1e-3
        )


# bf16 is judged against transformers' own bf16 model, on the same prompts on the same machine,
# both compared with transformers in fp32. bf16 matmuls round differently on CPUs with native
# bf16 (AVX-512 BF16, AMX) and without (AVX2, emulated): an absolute bound learned on one CPU
# failed on another (our max |diff| 1.20 on an AVX-512 machine, 2.28 on an AVX2 one, where
# transformers' own bf16 reached 1.34). Over all positions of the 4 prompts together (~160):
# - mean |diff|: ours <= 1.5 x theirs + 0.02. Measured ours / theirs 0.80-1.21 per prompt and
#   0.92 overall on AVX2, ~1.05 on AVX-512: two bf16 implementations round at different points.
#   A systematic error (an fp32 accumulation or norm done in bf16, a mis-rounded RoPE) shifts
#   every position and exceeds 1.5x.
# - max |diff|: ours <= 3 x theirs + 0.25. The max is one logit at the most sensitive position
#   (a near-tie); there ours / theirs measured 0.9-2.4. One broken position (a mask or RoPE
#   error at a block edge) is off by 10 or more (logits span ~40).
# - top-1 agreement with fp32: ours >= theirs - 0.03 (about 5 of 160 positions).
BF16_MEAN_FACTOR, BF16_MEAN_SLACK = 1.5, 0.02
BF16_MAX_FACTOR, BF16_MAX_SLACK = 3.0, 0.25
BF16_TOP1_SLACK = 0.03


def test_teacher_forced_bf16_logits_no_worse_than_transformers_bf16(
    hf_smollm2, hf_smollm2_bf16, prompts, hf_greedy, attention
):
    model, _ = hf_smollm2
    engine = LLMEngine(_stack("bfloat16", **attention))
    ours_diff, theirs_diff, ours_top1, theirs_top1 = [], [], [], []
    for ids, cont in zip(prompts[:4], hf_greedy[:4], strict=True):
        full = ids + cont
        ours = _forward_all(engine, full).logits.float()
        with torch.no_grad():
            ref = model(torch.tensor([full])).logits[0].float()
            theirs = hf_smollm2_bf16(torch.tensor([full])).logits[0].float()
        ours_diff.append((ours - ref).abs())
        theirs_diff.append((theirs - ref).abs())
        ours_top1.append(ours.argmax(-1) == ref.argmax(-1))
        theirs_top1.append(theirs.argmax(-1) == ref.argmax(-1))
    ours_diff, theirs_diff = torch.cat(ours_diff), torch.cat(theirs_diff)
    ours_top1 = torch.cat(ours_top1).float().mean().item()
    theirs_top1 = torch.cat(theirs_top1).float().mean().item()
    measured = (
        f"ours mean {ours_diff.mean():.3f} max {ours_diff.max():.3f} top-1 {ours_top1:.3f}; "
        f"transformers bf16 mean {theirs_diff.mean():.3f} max {theirs_diff.max():.3f} top-1 {theirs_top1:.3f}"
    )
    assert ours_diff.mean() <= BF16_MEAN_FACTOR * theirs_diff.mean() + BF16_MEAN_SLACK, measured
    assert ours_diff.max() <= BF16_MAX_FACTOR * theirs_diff.max() + BF16_MAX_SLACK, measured
    assert ours_top1 >= theirs_top1 - BF16_TOP1_SLACK, measured


def test_prompt_logprobs_match_transformers_across_chunks(engine_fp32, hf_smollm2, prompts):
    """Prompt logprobs come from logits at every prompt position — across prefill chunks (the
    budget is 64 tokens and this prompt is longer)."""
    model, _ = hf_smollm2
    ids = prompts[-1]
    assert len(ids) > 64
    rid = engine_fp32.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    out = None
    while engine_fp32.has_unfinished():
        for o in engine_fp32.step():
            if o.request_id == rid and o.finished:
                out = o
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry[ids[p]] == pytest.approx(ref[p - 1, ids[p]].item(), abs=2e-3)
        assert len(entry) <= 3
        best = int(ref[p - 1].argmax())
        assert best in entry


def test_seeded_sampling_survives_preemption(engine_fp32, engine_tight, prompts):
    """A preempted sequence recomputes its KV and then samples exactly what it would have."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_NEW) for i in range(8)]
    roomy = [o.token_ids for o in run_all(engine_fp32, prompts, params)]
    before = engine_tight.get_stats().num_preemptions
    squeezed = [o.token_ids for o in run_all(engine_tight, prompts, params)]
    assert engine_tight.get_stats().num_preemptions > before
    assert squeezed == roomy


def run_all(engine: LLMEngine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def _identity_with_drafts(shared_llm, prompts, hf_greedy, speculator, regime):
    """Run the oracle prompts with `speculator` under `regime`; assert transformers' greedy
    output, no KV left in use and, for "preemption", that preemption happened. Returns the
    engine's stats before and after."""
    spec = {"speculator": speculator}
    if regime == "preemption":
        engine = shared_llm(
            _stack(allocator={"num_blocks": 14}, scheduler={"max_num_batched_tokens": 256}, **spec)
        ).engine
    else:
        engine = shared_llm(_stack(**spec)).engine
    before = engine.get_stats()
    arrivals = {0: [0, 1, 2], 3: [3, 4], 7: [5, 6], 12: [7]} if regime == "arrivals" else None
    assert _run(engine, prompts, arrivals) == hf_greedy
    stats = engine.get_stats()
    assert stats.kv_usage == 0.0
    if regime == "preemption":
        assert stats.num_preemptions > before.num_preemptions, "the KV budget was meant to force preemption"
    return before, stats


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["chunked-prefill", "arrivals", "preemption"])
def test_greedy_equals_transformers_with_ngram_speculation(shared_llm, prompts, hf_greedy, regime):
    """Speculative decoding (prompt lookup, drafts always on) changes no greedy token: the
    oracle prompts under chunked prefill, mid-run arrivals and preemption."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    if "ngram" not in build_registry(make_plugin_manager()).names("speculator"):
        pytest.skip("lmstack-ngram is not installed")
    before, stats = _identity_with_drafts(
        shared_llm, prompts, hf_greedy, {"name": "ngram", "adaptive": False, "num_draft_tokens": 4}, regime
    )
    assert stats.num_draft_tokens > before.num_draft_tokens, "no drafts were verified"


@pytest.fixture(scope="module")
def smollm2_eagle_head(prompts, hf_greedy, tmp_path_factory):
    """An EAGLE head for SmolLM2 fitted (seconds) to the oracle prompts' own greedy answers, so
    that its drafts are accepted often and the identity below covers accepted drafts, not only
    rejected ones."""
    pytest.importorskip("lmstack_eagle")
    from lmstack.model.source import open_model_source
    from lmstack_calibrate.model import DenseModel
    from lmstack_eagle.head import HeadConfig, save_head
    from lmstack_eagle.train import Target, train_head

    source = open_model_source("smollm2-135m-instruct")
    target = Target(DenseModel.load(source))
    seqs = [list(p) + list(g) for p, g in zip(prompts, hf_greedy, strict=True)]
    feats = [target.features(s) for s in seqs]
    torch.manual_seed(0)
    head, _ = train_head(
        target,
        HeadConfig.for_target(source.config),
        seqs,
        feats,
        epochs=40,
        lr=3e-3,
        unroll=2,
        progress=False,
    )
    return save_head(head, tmp_path_factory.mktemp("smollm2-eagle"))


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["chunked-prefill", "arrivals", "preemption"])
def test_greedy_equals_transformers_with_eagle_speculation(
    shared_llm, prompts, hf_greedy, smollm2_eagle_head, regime
):
    """EAGLE drafts (always on, 4 per step) change no greedy token: the oracle prompts under
    chunked prefill, mid-run arrivals and preemption, with drafts accepted along the way."""
    speculator = {"name": "eagle", "head": str(smollm2_eagle_head), "adaptive": False, "num_draft_tokens": 4}
    before, stats = _identity_with_drafts(shared_llm, prompts, hf_greedy, speculator, regime)
    assert stats.num_accepted_tokens > before.num_accepted_tokens, "no draft was accepted"
    assert (
        stats.num_draft_tokens - before.num_draft_tokens
        > stats.num_accepted_tokens - before.num_accepted_tokens
    )


@pytest.mark.slow
def test_the_bundled_eagle_head_drafts_the_oracle_answers(shared_llm, prompts, hf_greedy):
    """The head lmstack-eagle ships for SmolLM2 (`head: smollm2-135m-instruct`, trained on chat
    answers, none of these prompts among them) leaves transformers' greedy output unchanged and
    is a trained head: its drafts are accepted (56 of 283 when written, with the plain-text
    continuations among these prompts; an untrained head's: next to none)."""
    pytest.importorskip("lmstack_eagle")
    from lmstack_eagle.head import bundled_heads

    assert "smollm2-135m-instruct" in bundled_heads()
    speculator = {"name": "eagle", "head": "smollm2-135m-instruct", "adaptive": False, "num_draft_tokens": 4}
    before, stats = _identity_with_drafts(shared_llm, prompts, hf_greedy, speculator, "chunked-prefill")
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.1, f"{accepted} of {drafted} drafts accepted"
