"""Decode steps with the decoder layers' (or, `--what head`, the Q8_0 LM head's) GGUF panels from
one row against from PANELS_MIN_ROWS, in one process: two engines of the same stack, alternating run by run
(ABBA), so that a noisy machine's drift falls on both alike.

    python benchmarks/ab/panels_from_ab.py --stack examples/stacks/cpu.yaml [--batches 1 4 8] \\
        [--rounds 12] [--new-tokens 24] [--out DIR]

`lmstack_gguf.quantizer.layer_panels_min_rows` / `head_panels_min_rows` pick the crossovers the
stack gets (README); this script builds engine A with PANELS_MIN_ROWS and engine B with one row
for the part under test, on any CPU whose kernels run the panels, whatever they would pick. Each run submits `batch` prompts of 200
token ids, takes the prefill step, then times the decode steps to the end (exactly
`--new-tokens` tokens each, greedy). Writes `panels_from_ab.json` (CPU named; every run's ms per
decode step; medians, their ratio B / A and the median of the paired ratios) and prints them.
A batch of PANELS_MIN_ROWS rows or more multiplies by the panels in both engines (B through the
bound direct path, A through the module's generic one): its ratio is the noise plus that Python
overhead. Quote ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lmstack_bench.toolbox import ab_order, ab_record, result_dir

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack.engine.llm_engine import LLMEngine


def decode_ms_per_step(engine: LLMEngine, batch: int, new_tokens: int) -> float:
    from lmstack.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request([100 + i + j for j in range(200)], params)
    engine.step()  # the prefill
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stack", type=Path, required=True, help="a stack with gguf weights or awq int8 activations"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--what", choices=["layers", "head"], default="layers", help="whose crossover to vary")
    args = ap.parse_args(argv)

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.stack.config import load_stack
    from lmstack_gguf import quantizer

    if not quantizer.panels_cpu():
        print("the GGUF panel kernel does not run on this machine (AVX2 and the built kernels needed)")
        return 1
    # The choice under test (the decoder layers' or the LM head's crossover) from PANELS_MIN_ROWS
    # in engine A and from one row in engine B; the other as the quantizer picks it.
    name = "layer_panels_min_rows" if args.what == "layers" else "head_panels_min_rows"
    chosen = getattr(quantizer, name)
    try:
        setattr(quantizer, name, lambda: quantizer.PANELS_MIN_ROWS)
        engine_a = LLMEngine(load_stack(args.stack))
        setattr(quantizer, name, lambda: 1)
        engine_b = LLMEngine(load_stack(args.stack))
    finally:
        setattr(quantizer, name, chosen)
    decode_ms_per_step(engine_a, 1, 4)  # warm-up
    decode_ms_per_step(engine_b, 1, 4)

    results = []
    for batch in args.batches:
        a, b = [], []
        for r in range(args.rounds):
            pair = [{"a": engine_a, "b": engine_b}[n] for n in ab_order(["b", "a"], r)]
            times = {id(e): decode_ms_per_step(e, batch, args.new_tokens) for e in pair}
            a.append(times[id(engine_a)])
            b.append(times[id(engine_b)])
        row = {
            "batch": batch,
            "panels_in_both": batch >= quantizer.PANELS_MIN_ROWS,
            "from_min_rows_ms": [round(t, 3) for t in a],
            "from_one_row_ms": [round(t, 3) for t in b],
            "median_from_min_rows_ms": round(statistics.median(a), 3),
            "median_from_one_row_ms": round(statistics.median(b), 3),
            "ratio_of_medians": round(statistics.median(b) / statistics.median(a), 3),
            "median_paired_ratio": round(statistics.median(y / x for x, y in zip(a, b)), 3),
        }
        results.append(row)
        print(
            f"batch {batch}{' (panels in both)' if row['panels_in_both'] else ''}: panels from "
            f"{quantizer.PANELS_MIN_ROWS} rows {row['median_from_min_rows_ms']} ms/step, from one row "
            f"{row['median_from_one_row_ms']} ms/step: {row['ratio_of_medians']}x "
            f"(paired {row['median_paired_ratio']}x)",
            flush=True,
        )
    out = args.out or result_dir("panels_from_ab")
    ab_record(
        out / "panels_from_ab.json",
        results,
        ratios={f"batch {r['batch']}: from one row / from min rows": r["ratio_of_medians"] for r in results},
        benchmark="panels_from_ab",
        stack=str(args.stack),
        what=args.what,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
    )
    print(f"wrote {out / 'panels_from_ab.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
