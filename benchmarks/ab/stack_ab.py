"""A/B of whole stacks in one process: the same prompts through each stack's offline engine,
alternating stack by stack each round, so that a noisy machine's drift falls on all alike.

    python benchmarks/ab/stack_ab.py STACK_A STACK_B [...] [--rounds 4] [--prompts 32] \\
        [--prompt-len 200] [--new-tokens 1 64] [--out DIR]

Each round runs, per stack and per `--new-tokens` value T, all prompts at once (greedy, exactly T
new tokens each) and times until the last finishes: T = 1 is prefill (and one sampled token),
larger T adds the decode steps. Prompts are random token ids of `--prompt-len` +-10 %. Writes
`stack_ab.json` (CPU named, every time, medians and the ratio of each stack's median to the
first's) and prints the medians. Quote the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack.engine.llm_engine import LLMEngine
from lmstack_bench.toolbox import ab_order, ab_record, result_dir


def run_all(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds from submitting every prompt until the last request finishes."""
    from lmstack.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    pending = {engine.add_request(p, params) for p in prompts}
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks", nargs="+", type=Path, help="stack files; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from lmstack.engine.llm_engine import LLMEngine

    rng = random.Random(args.seed)
    spread = max(1, args.prompt_len // 10)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt_len + rng.randint(-spread, spread))]
        for _ in range(args.prompts)
    ]
    engines = {str(s): LLMEngine(str(s)) for s in args.stacks}
    for engine in engines.values():  # warm-up: first calls build caches and pack weights
        run_all(engine, prompts[:4], 2)
    times: dict[str, dict[int, list[float]]] = {s: {t: [] for t in args.new_tokens} for s in engines}
    for r in range(args.rounds):
        for name in ab_order(list(engines), r):
            engine = engines[name]
            for t in args.new_tokens:
                times[name][t].append(run_all(engine, prompts, t))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = str(args.stacks[0])
    medians = {s: {t: statistics.median(v) for t, v in per.items()} for s, per in times.items()}
    ratios = {s: {t: medians[s][t] / medians[base][t] for t in args.new_tokens} for s in medians}
    out = args.out or result_dir("stack_ab")
    ab_record(
        out / "stack_ab.json",
        {"seconds": times, "median_s": medians, "ratio_vs_first": ratios},
        ratios={f"{s} T={t}": ratios[s][t] for s in medians if s != base for t in args.new_tokens},
        threads=torch.get_num_threads(),
        workload={
            "prompts": args.prompts,
            "prompt_tokens": sum(len(p) for p in prompts),
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
        },
        note="same process, stacks alternating each round (ABBA); compare ratios, not absolute times",
    )
    for s in medians:
        cells = ", ".join(f"T={t}: {medians[s][t]:.2f} s ({ratios[s][t]:.2f}x)" for t in args.new_tokens)
        print(f"{s}: {cells}")
    print(f"wrote {out / 'stack_ab.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
