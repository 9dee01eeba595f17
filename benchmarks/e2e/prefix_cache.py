"""Median time to first token through the HTTP API with the prefix cache off and on, same run.

For each cache setting a `lmstack serve` process is started with the same stack (only `cache:`
differs) and `lmstack bench serve` drives it, one server at a time (the other is stopped, so
they never share the CPU):

- `shared-prefix`: every request is a system prompt of --prefix-len tokens (one of
  --num-prefixes) plus a short new question. Target: median TTFT >= 5x lower with the cache.
- `multi-turn`: conversations of --turns turns, each sent with the whole history. Target:
  median TTFT of turns 2+ >= 2x lower with the cache.

    python benchmarks/e2e/prefix_cache.py                 # writes benchmarks/results/prefix_cache-DATE.*
    python benchmarks/e2e/prefix_cache.py --requests 6    # quicker
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmstack_bench.toolbox import machine_info, result_dir

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack_api.testing import ServerProcess

REPO = Path(__file__).resolve().parents[2]
CACHES = {"off": {"name": "none"}, "on": {"name": "prefix"}}
TARGETS = {"shared-prefix": 5.0, "multi-turn": 2.0}


def stack(cache: dict, dtype: str) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": dtype,
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "512MiB"},
        "cache": cache,
    }


def bench_args(workload: str, a: argparse.Namespace) -> list[str]:
    common = ["--endpoint", "chat", "--concurrency", "1", "--num-requests", str(a.requests)]
    common += ["--warmup", "1", "--no-progress", "--no-plot", "--seed", "7"]
    if workload == "shared-prefix":
        return [*common, "--workload", "shared-prefix", "--prefix-len", str(a.prefix_len),
                "--num-prefixes", "2", "--input-len", "24", "--output-len", "4"]  # fmt: skip
    return [*common, "--workload", "multi-turn", "--turns", str(a.turns), "--input-len", "48",
            "--output-len", "96"]  # fmt: skip


def run_bench(server: ServerProcess, args: list[str], out: Path, label: str) -> dict:
    cli = [sys.executable, "-c", "import sys; from lmstack.cli import main; sys.exit(main())"]
    cmd = [*cli, "bench", "serve", "--base-url", server.base_url, "--label", label, "--out", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def ttfts(result: dict, min_turn: int = 0) -> list[float]:
    reqs = result["runs"][0]["requests"]
    return [r["ttft_s"] for r in reqs if r["error"] is None and r["turn"] >= min_turn]


def cached(result: dict, min_turn: int = 0) -> list[int]:
    reqs = result["runs"][0]["requests"]
    return [r["cached_tokens"] or 0 for r in reqs if r["error"] is None and r["turn"] >= min_turn]


def lscpu_model_name() -> str | None:
    import subprocess

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/prefix_cache-<date>-<cpu kind>)",
    )
    a = p.parse_args()

    from lmstack_api.testing import ServerProcess

    a.out = result_dir("prefix_cache", a.out)
    raw: dict[str, dict[str, dict]] = {w: {} for w in TARGETS}
    for setting, cache in CACHES.items():
        with ServerProcess(stack(cache, a.dtype)) as server:
            for workload in TARGETS:
                out = a.out / f"{workload}-cache-{setting}.json"
                raw[workload][setting] = run_bench(server, bench_args(workload, a), out, f"cache {setting}")
                print(f"{workload} cache {setting}: done", file=sys.stderr)
    summary = {}
    for workload, target in TARGETS.items():
        min_turn = 1 if workload == "multi-turn" else 0
        med = {s: statistics.median(ttfts(raw[workload][s], min_turn)) for s in CACHES}
        summary[workload] = {
            "median_ttft_s": med,
            "ratio": med["off"] / med["on"],
            "target": target,
            "met": med["off"] / med["on"] >= target,
            "turns_counted": "2 and later" if min_turn else "all",
            "median_cached_tokens": {
                s: statistics.median(cached(raw[workload][s], min_turn)) for s in CACHES
            },
            "bench_args": bench_args(workload, a),
        }
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/e2e/prefix_cache.py " + shlex.join(sys.argv[1:]),
        "machine": {**machine_info(), "lscpu_model_name": lscpu_model_name()},
        "stack": stack({"name": "none | prefix"}, a.dtype),
        "summary": summary,
    }
    (a.out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(raw, summary, a.out / "ttft.png")
    for workload, s in summary.items():
        print(f"{workload}: median TTFT off {s['median_ttft_s']['off'] * 1000:.0f} ms, "
              f"on {s['median_ttft_s']['on'] * 1000:.0f} ms: {s['ratio']:.1f}x (target {s['target']:g}x)")  # fmt: skip
    return 0


def plot(raw: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(raw), figsize=(10, 4))
    for ax, (workload, by_setting) in zip(axes, raw.items(), strict=True):
        min_turn = 1 if workload == "multi-turn" else 0
        data = [[t * 1000 for t in ttfts(by_setting[s], min_turn)] for s in CACHES]
        ax.boxplot(data, tick_labels=[f"cache {s}" for s in CACHES])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms)")
        s = summary[workload]
        ax.set_title(f"{workload} ({s['turns_counted']} turns): {s['ratio']:.1f}x lower")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
