"""Prefill that does not starve decode: the `continuous` scheduler with and without its
step-time target, same server stack otherwise, one run, interleaved.

Each variant is `examples/stacks/cpu.yaml` (or --stack) with `scheduler.max_step_ratio` set
(0: off, chunks take the whole token budget; the default 2.5). Every round starts each variant's
server in turn and drives it with `lmstack bench serve` (closed loop, ~200-token prompts, 128
output tokens, greedy); the report gives, per variant, output tok/s, TTFT median / P99 and the
gap between a stream's tokens (ITL median / P99 and their ratio, the issue's "ITL P99 <= 3x
median"), medians over rounds, and the ratios against "off".

    python benchmarks/e2e/prefill_stall.py                       # concurrency 32, 2 rounds (~10 min)
    python benchmarks/e2e/prefill_stall.py --ratios 0,2.5,1.5 --concurrency 16 --rounds 1

Writes benchmarks/results/prefill_stall-<date>-<cpu kind>/prefill_stall.{json,png}, naming the CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lmstack_bench.report import load_result
from lmstack_bench.toolbox import Server, git_info, machine_info, result_dir, started, write_result

REPO = Path(__file__).resolve().parents[2]
LMSTACK = str(Path(sys.executable).with_name("lmstack"))
MODEL = "smollm2-135m-instruct"


def serving(stack: Path, log: Path, name: str):
    """`lmstack serve STACK` on a free port until healthy (compare_servers' launcher)."""
    from lmstack_api.testing import free_port

    port = free_port()
    argv = [LMSTACK, "serve", str(stack), "--port", str(port), "--log-level", "warning"]
    return started(Server(name=name, argv=argv, port=port), log, timeout_s=600.0)


def bench(base: str, label: str, args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [LMSTACK, "bench", "serve", "--base-url", base, "--model", MODEL, "--tokenizer", MODEL,
           "--label", label, "--concurrency", str(args.concurrency),
           "--num-requests", str(args.requests or 2 * args.concurrency), "--warmup", "4",
           "--input-len", str(args.input_len), "--input-len-spread", "0.1",
           "--output-len", str(args.output_len), "--out", str(out), "--no-plot", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return cmd


def measure(path: Path) -> dict[str, float]:
    s = load_result(path).runs[0].summary
    return {
        "output_tok_s": s.output_throughput,
        "ttft_median_ms": s.ttft.median,
        "ttft_p99_ms": s.ttft.p99,
        "itl_median_ms": s.itl.median,
        "itl_p99_ms": s.itl.p99,
        "itl_p99_over_median": s.itl.p99 / s.itl.median,
        "failed": s.failed,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["variants"])
    keys = [("itl_p99_over_median", "ITL P99 / median"), ("ttft_p99_ms", "TTFT P99 (ms)"),
            ("output_tok_s", "output tok/s")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    for ax, (key, title) in zip(axes, keys):
        ax.bar(names, [report["variants"][n]["median"][key] for n in names], color="#4c72b0")
        ax.set_title(title)
        if key == "itl_p99_over_median":
            ax.axhline(3.0, color="#c44e52", ls="--", lw=1, label="target <= 3")
            ax.legend()
    fig.suptitle(f"{report['machine'].get('cpu_model')}: concurrency {report['concurrency']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", type=Path, default=REPO / "examples/stacks/cpu.yaml")
    ap.add_argument("--ratios", default="0,2.5", help="max_step_ratio values (0: off)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0, help="per run (default 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/prefill_stall-<date>-<cpu kind>)",
    )
    args = ap.parse_args()
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so no server is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    base_stack = yaml.safe_load(args.stack.read_text())
    ratios = [float(r) for r in args.ratios.split(",")]
    names = {r: "off" if r == 0 else f"ratio {r:g}" for r in ratios}
    work = Path(tempfile.mkdtemp(prefix="prefill_stall-"))
    stacks = {}
    for r in ratios:
        stack = {**base_stack, "scheduler": {**base_stack.get("scheduler", {}), "max_step_ratio": r}}
        stacks[r] = work / f"stack-{r:g}.yaml"
        stacks[r].write_text(yaml.safe_dump(stack))
    runs: dict[str, list[dict[str, float]]] = {names[r]: [] for r in ratios}
    command = None
    for rnd in range(args.rounds):
        for r in ratios:
            with serving(stacks[r], work / f"server-{r:g}-{rnd}.log", names[r]) as base:
                out = work / f"{r:g}-{rnd}.json"
                command = bench(base, names[r], args, out)
            runs[names[r]].append(measure(out))
            print(f"round {rnd}: {names[r]}: {json.dumps(runs[names[r]][-1])}", file=sys.stderr)

    variants = {}
    for name, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        variants[name] = {"median": med, "runs": rs}
    off = variants.get("off")
    if off:
        for v in variants.values():
            v["vs_off"] = {k: v["median"][k] / off["median"][k] for k in
                           ("output_tok_s", "ttft_p99_ms", "itl_p99_ms", "itl_p99_over_median")}  # fmt: skip
    report = {
        "date": dt.date.today().isoformat(),
        "machine": machine_info(),
        "git": git_info(),
        "threads": os.environ.get("OMP_NUM_THREADS", "default (affinity)"),
        "stack": str(args.stack.relative_to(REPO) if args.stack.is_relative_to(REPO) else args.stack),
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "variants": variants,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "bench_command_last": command,
    }
    out = result_dir("prefill_stall", args.out)
    write_result(out, "prefill_stall", report, plot)
    for name, v in variants.items():
        m = v["median"]
        print(f"{name:>10}: {m['output_tok_s']:.1f} tok/s, TTFT p99 {m['ttft_p99_ms']:.0f} ms, "
              f"ITL p50 {m['itl_median_ms']:.0f} / p99 {m['itl_p99_ms']:.0f} ms "
              f"(x{m['itl_p99_over_median']:.2f})")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
