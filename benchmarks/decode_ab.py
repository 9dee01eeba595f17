"""A/B of decode speed between two lmstack source trees: runs decode_profile.py for each,
alternating, and writes medians and after/before ratios (noisy shared machines: only those).

    OMP_NUM_THREADS=1 python benchmarks/decode_ab.py --before /tmp/base/core --rounds 3 \\
        --out benchmarks/results/fused-ops-2026-12-01/decode_ab.json

`--before` / `--after`: a `core` directory put first on PYTHONPATH (empty: the installed one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(pythonpath: str, batch: int, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(HERE / "decode_profile.py"), "--dtype", args.dtype, "--batch", str(batch),
               "--new-tokens", str(args.new_tokens[batch]), "--repeats", str(args.repeats), "--json", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": pythonpath}
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())[0]["runs"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=3, help="before/after process pairs per batch")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.new_tokens = {b: 64 if b == 1 else 32 for b in args.batches}

    import torch

    from lmstack.hardware import cpu_name

    result: dict = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": "OMP_NUM_THREADS=1 python " + " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "model": "smollm2-135m-instruct",
        "dtype": args.dtype,
        "batches": {},
    }
    for batch in args.batches:
        runs: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):  # interleaved
            runs["before"] += run(args.before, batch, args)
            runs["after"] += run(args.after, batch, args)
        med = {k: statistics.median(v) for k, v in runs.items()}
        result["batches"][str(batch)] = {
            "new_tokens": args.new_tokens[batch],
            "median_tok_s": {k: round(v, 2) for k, v in med.items()},
            "median_ms_per_step": {k: round(1e3 * batch / v, 2) for k, v in med.items()},
            "after_over_before_tok_s": round(med["after"] / med["before"], 3),
            "runs_tok_s": runs,
        }
        print(batch, json.dumps(result["batches"][str(batch)]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
