"""The disk tier across a server restart: time to first token of a long prompt on a cold server
vs on a restarted server whose `tiered` cache directory already holds that prompt.

1. start `lmstack serve` with `cache: {name: tiered, disk_path: DIR}` on an empty DIR;
2. send a --prompt-tokens prompt (random vocabulary ids, max_tokens 1): cold TTFT;
3. stop the server (SIGTERM: it drains and its cache finishes writing), start a new one on DIR;
4. send the same prompt: TTFT and `usage.prompt_tokens_details.cached_tokens`.

Target: TTFT >= 3x lower after the restart, cached_tokens > 0. Repeated --repeats times, each
with a fresh directory and a new prompt.

    python benchmarks/e2e/tiered_restart.py            # writes benchmarks/results/tiered_restart-DATE.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from lmstack_bench.toolbox import machine_info, result_dir, write_json

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack_api.testing import ServerProcess

REPO = Path(__file__).resolve().parents[2]
TARGET = 3.0


def stack(disk: str, dtype: str) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": dtype,
        "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "512MiB"},
        "cache": {"name": "tiered", "disk_path": disk, "disk_capacity": "4GiB"},
    }


def ttft(server: ServerProcess, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens from the usage chunk)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and first is None:
                first = time.perf_counter() - start
            if obj.get("usage"):
                cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


def lscpu_model_name() -> str | None:
    import subprocess

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/tiered_restart-<date>-<cpu kind>)",
    )
    a = p.parse_args()

    from lmstack_api.testing import ServerProcess

    runs = []
    for rep in range(a.repeats):
        rng = random.Random(rep)
        prompt = [rng.randrange(1000, 40000) for _ in range(a.prompt_tokens)]
        with tempfile.TemporaryDirectory(prefix="lmstack-kv-") as disk:
            with ServerProcess(stack(disk, a.dtype)) as server:
                ttft(server, [rng.randrange(1000, 40000) for _ in range(32)])  # warm the server up
                cold, cold_cached = ttft(server, prompt)
                assert server.terminate() == 0
                files = len(list(Path(disk).glob("*.kv")))
            with ServerProcess(stack(disk, a.dtype)) as server:
                ttft(server, [rng.randrange(1000, 40000) for _ in range(32)])
                warm, warm_cached = ttft(server, prompt)
        runs.append({"cold_ttft_s": cold, "cold_cached_tokens": cold_cached, "files_after_stop": files,
                     "restarted_ttft_s": warm, "restarted_cached_tokens": warm_cached})  # fmt: skip
        print(f"run {rep}: cold {cold * 1000:.0f} ms, after restart {warm * 1000:.0f} ms "
              f"({warm_cached} cached tokens, {files} block files)", file=sys.stderr)  # fmt: skip
    cold = statistics.median(r["cold_ttft_s"] for r in runs)
    warm = statistics.median(r["restarted_ttft_s"] for r in runs)
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/e2e/tiered_restart.py " + shlex.join(sys.argv[1:]),
        "machine": {**machine_info(), "lscpu_model_name": lscpu_model_name()},
        "stack": stack("<temporary directory>", a.dtype),
        "prompt_tokens": a.prompt_tokens,
        "runs": runs,
        "median_cold_ttft_s": cold,
        "median_restarted_ttft_s": warm,
        "ratio": cold / warm,
        "target": TARGET,
        "met": cold / warm >= TARGET and all(r["restarted_cached_tokens"] > 0 for r in runs),
    }
    path = write_json(result_dir("tiered_restart", a.out) / "tiered_restart.json", record)
    print(f"median TTFT cold {cold * 1000:.0f} ms, after restart {warm * 1000:.0f} ms: {cold / warm:.1f}x "
          f"(target {TARGET:g}x); wrote {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
