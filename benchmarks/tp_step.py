"""Decode step time of SmolLM2-135M (fp32) in one process and split over `tp` ranks, and the
bytes the tensor-parallel ranks exchange per decode step.

    python benchmarks/tp_step.py                 # single vs tp=3, batch 1 and 8, on the CPU
    python benchmarks/tp_step.py --tp 3 --device cuda --batch 1 8 64

Each configuration: one engine, `--batch` greedy requests of a short prompt with --tokens new
tokens; every `engine.step()` after the first token of every request is a pure decode step of
the whole batch; the median of those steps is reported. Bytes per decode step are counted from
the layout (per rank, sent and received alike by a ring): 2 all-reduces of [batch, hidden] per
layer, 1 for the embedding, and the logits all-gather of [batch, vocab], in the activation
dtype. Writes benchmarks/results/tp_step-<date>.json and prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _stack(model: str, device: str, tp: int) -> dict:
    return {
        "model": model,
        "dtype": "float32",
        "device": device,
        "scheduler": {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 4096},
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 512},
        "parallel": {"name": "tp", "tp": tp} if tp > 1 else {"name": "single"},
    }


def _decode_steps(llm, batch: int, tokens: int) -> list[float]:
    from lmstack import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request("The capital of France is", params)
    engine.step()  # the prefill step: every request gets its first token
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[:-1] or times  # the last step also finishes requests


def _bytes_per_decode_step(mc, batch: int, tp: int, itemsize: int = 4) -> int:
    if tp == 1:
        return 0
    reduce = batch * mc.hidden_size * itemsize * 2 * (tp - 1) // tp  # ring all-reduce, per rank
    gather = batch * mc.vocab_size * itemsize * (tp - 1) // tp  # all-gather, per rank received
    return (2 * mc.num_layers + 1) * reduce + gather


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of the engine process (a single rank)"
    )
    args = ap.parse_args()

    import torch

    # On a shared CPU torch's default (all cores) spins against other processes: a single decode
    # step measured 9.5 s that way under load 19 on 2 cores. The tp ranks take cores // tp each.
    torch.set_num_threads(args.threads)

    from lmstack.llm import LLM

    rows = []
    for tp in (1, args.tp):
        t = time.perf_counter()
        llm = LLM(_stack(args.model, args.device, tp))
        load = time.perf_counter() - t
        mc = llm.engine.model_config
        for batch in args.batch:
            steps = _decode_steps(llm, batch, args.tokens)
            rows.append(
                {
                    "tp": tp,
                    "batch": batch,
                    "decode_step_ms_median": round(1000 * statistics.median(steps), 2),
                    "steps": len(steps),
                    "bytes_per_decode_step_per_rank": _bytes_per_decode_step(mc, batch, tp),
                    "load_s": round(load, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        llm.engine.shutdown()
    out = {
        "model": args.model,
        "device": args.device,
        "cpu": _cpu(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "engine_threads": args.threads,
        "rows": rows,
    }
    path = Path(__file__).parent / "results" / f"tp_step-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
