"""Batch-1 decode of lmstack alone: tokens/s over repeated runs, or a cProfile of one run.

Meant for A/B checks of engine changes: run it with two checkouts' interpreters, alternating,
on a quiet machine, and compare medians (and, with --profile, the function calls per token: a
change that adds per-step Python work shows up there even when the timings are noisy).

    python benchmarks/decode_profile.py --dtype bfloat16 --repeats 5
    python benchmarks/decode_profile.py --profile --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lmstack_stack  # noqa: E402


def decode_once(engine, prompt: list[int], new_tokens: int) -> float:
    """Tokens/s after the first token, for one greedy request run to `new_tokens`."""
    from lmstack.sampling_params import SamplingParams

    engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    # stamps[0] is the prefill step (first token); the rest are one token each.
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--profile", action="store_true", help="profile one run instead of timing")
    p.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    args = p.parse_args(argv)
    if args.new_tokens < 3 or args.prompt_len < 1 or args.repeats < 1:
        p.error("--new-tokens must be >= 3, --prompt-len and --repeats >= 1")

    from lmstack.engine import LLMEngine

    engine = LLMEngine(lmstack_stack(args.model, args.dtype, max_num_seqs=16))
    prompt = list(range(100, 100 + args.prompt_len))
    try:
        decode_once(engine, prompt, args.new_tokens)  # warm-up
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            decode_once(engine, prompt, args.new_tokens)
            prof.disable()
            stats = pstats.Stats(prof, stream=sys.stdout)
            print(f"{stats.total_calls} function calls for {args.new_tokens} tokens "
                  f"({stats.total_calls / args.new_tokens:.0f} per token)")  # fmt: skip
            stats.sort_stats("tottime").print_stats(args.top)
        else:
            runs = [decode_once(engine, prompt, args.new_tokens) for _ in range(args.repeats)]
            print(f"{args.dtype} batch-1 decode: median {statistics.median(runs):.2f} tok/s "
                  f"over {args.repeats} runs {[round(r, 1) for r in runs]}")  # fmt: skip
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
