"""Greedy output of the default stack (`lmstack serve MODEL` with no stack: every section auto)
does not depend on how a prompt reaches the model: alone or among batch-mates, with its prefix
from the prefix cache or computed, prefilled at once or in chunks. Each path changes which rows
share a kernel call and where a prompt's rows start; the default stack computes every row alike
whatever shares its call (lmstack-gguf's panels for every batch of the layers and the LM head,
cpu-paged's fixed key parts), so the tokens are the same bits.

The oracle is the same model's plain path: each prompt alone, no cache, prefilled at once. Not
only the tokens are compared but each chosen token's log-probability, exactly: a path that
changed a logit in its last bit shows there even when no greedy choice flipped (yet).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 16
# Three prompts share a prefix of many KV blocks (16 tokens each), so the prefix cache serves
# it to the second and third, and of over 256 tokens, so a prompt prefilled at once is a step
# of over 256 rows (where `prefill: panels+bf16`, the AMX default once, switched to its bf16
# copy) while its cached or chunked variants are not; one prompt shares nothing.
PREFIX = (
    "Notes from a week at the coast. On Monday the wind came from the west and the fishing boats "
    "stayed in the harbour; the gulls sat on the sea wall and watched the nets drying in rows. "
    "Tuesday was calm and bright, so we walked along the cliffs to the old lighthouse, where a "
    "keeper once lived with his two dogs and a goat that ate the washing. The path was narrow, "
    "the grass was full of thrift and sea campion, and far below seals lay on the black rocks. "
    "On Wednesday it rained from dawn to dusk. We read in the cafe by the station, drank too much "
    "tea, and played cards with a retired teacher who had sailed to Iceland in a small wooden "
    "boat when she was young. Thursday brought fog so thick that the church bell was rung every "
    "hour to guide the ferry in. Friday we caught mackerel from the pier with borrowed rods and "
    "cooked them on the beach, and a fox came down the dunes at dusk to look at the fire. On "
    "Saturday the market filled the square with cheese, bread, crabs and knitted hats, and a "
    "brass band played until the rain returned. We left on Sunday morning on the early train, "
    "with sand still in our shoes and a jar of honey from the farm on the hill behind the town.\n"
)
PROMPTS = [
    PREFIX + "Question: What did the fox do on Friday? Answer:",
    PREFIX + "Question: Who lived in the lighthouse? Answer:",
    PREFIX + "Question: Why was the church bell rung on Thursday? Answer:",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def llms(smollm2_path):
    from lmstack import LLM

    built = {
        "default": LLM({"model": MODEL}),
        "no_cache": LLM({"model": MODEL, "cache": {"name": "none"}}),
        # Prefill in chunks of 16 tokens: every prompt above takes several steps.
        "chunked": LLM(
            {
                "model": MODEL,
                "cache": {"name": "none"},
                "scheduler": {"name": "continuous", "max_num_batched_tokens": 16},
            }
        ),
    }
    yield built
    for llm in built.values():
        llm.engine.shutdown()


def greedy(out) -> list[tuple[int, float]]:
    """Each generated token with its log-probability."""
    sample = out.outputs[0]
    return [(t, lp[t]) for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]


def tokens(llm, prompts) -> list[list[tuple[int, float]]]:
    return [greedy(out) for out in llm.generate(list(prompts), params())]


def params():
    from lmstack import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def alone(llm) -> list[list[int]]:
    return [tokens(llm, [p])[0] for p in PROMPTS]


def test_default_stack_is_what_this_test_is_about(llms):
    # The auto defaults: lmstack-gguf with int8 activations (the panels wherever they run),
    # cpu-paged attention, the prefix cache. If they change, this test must be revisited.
    stack = llms["default"].engine.stack
    assert stack.quantizer.options.activations == "int8"
    assert stack.selected["attention_prefill"].component.name == "cpu-paged"
    assert stack.selected["cache"].component.name == "prefix"


def test_batch_mates_prefix_cache_and_chunking_never_change_greedy_tokens(llms):
    want = alone(llms["no_cache"])
    assert len({tuple(t for t, _ in w) for w in want}) == len(PROMPTS)

    # (a)+(c): alone with the prefix cache on: the 2nd and 3rd prompts reuse the 1st's blocks.
    default = llms["default"]
    outs = [default.generate([p], params())[0] for p in PROMPTS]
    assert [greedy(o) for o in outs] == want, "prefix cache on vs cache: none"
    assert outs[1].num_cached_tokens >= 32 and outs[2].num_cached_tokens >= 32, (
        "the prefix cache served nothing: the test checked nothing",
        [o.num_cached_tokens for o in outs],
    )
    # (b): all prompts in one batch, with and without the cache (warm now: every prompt hits).
    assert tokens(llms["no_cache"], PROMPTS) == want, "batched vs alone"
    assert tokens(default, PROMPTS) == want, "batched with cached prefixes vs alone"
    # A prompt among copies of another prompt and in another position of the batch.
    mixed = [PROMPTS[3], PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1]]
    assert tokens(llms["no_cache"], mixed) == [want[3], want[0], want[3], want[2], want[1]]
    # (d): chunked prefill (16 tokens a step), alone and batched.
    chunked = llms["chunked"]
    assert alone(chunked) == want, "chunked prefill vs at once"
    assert tokens(chunked, PROMPTS) == want, "chunked prefill, batched"
