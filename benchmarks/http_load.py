"""A bounded load test of `lmstack serve` on loopback: many concurrent streaming clients for a
fixed time, plus clients that disconnect mid-stream; checks that nothing fails or is lost and
that every KV block comes back.

    python benchmarks/http_load.py                       # 64 clients, 60 s, 10 disconnecting
    python benchmarks/http_load.py --clients 8 --duration 10 --disconnects 2   # smoke

Writes benchmarks/results/http_load-<date>.json. Pass criteria (all must hold): 0 failed
streams, 0 lost (each ends with [DONE] and a usage count equal to the tokens received), KV blocks
in use and running requests back to 0 at the end, and the aborted-request counter up by exactly
the number of disconnecting clients.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import stream_completion  # noqa: E402

from lmstack_api.testing import ServerProcess  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORDS = "river mountain engine garden signal market winter lantern copper harbor violin meadow".split()


def prompt(rng: random.Random) -> str:
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + "."


def stack(args) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "bfloat16",
        "scheduler": {"name": "continuous", "max_num_seqs": args.clients, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
        "server": {"max_waiting_requests": 4 * args.clients},
    }


async def run(args, srv: ServerProcess) -> dict:
    limits = httpx.Limits(max_connections=args.clients + args.disconnects + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        stop_at = time.monotonic() + args.duration
        results = []

        async def worker(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < stop_at:
                n = rng.randint(16, 128)
                body = {
                    "prompt": prompt(rng),
                    "max_tokens": n,
                    "temperature": 0.8,
                    "seed": rng.randrange(10**6),
                }
                results.append(await stream_completion(client, srv.base_url, body))

        async def leaver(i: int) -> None:
            await asyncio.sleep(args.duration * (0.2 + 0.5 * i / max(1, args.disconnects)))
            body = {"prompt": prompt(random.Random(-i)), "max_tokens": 400, "ignore_eos": True}
            r = await stream_completion(client, srv.base_url, body, stop_after_chunks=5)
            leavers.append(r)

        leavers: list = []
        aborted_before = srv.metric("lmstack:request_aborted_total")
        kv_samples = []

        async def sample_kv() -> None:
            while time.monotonic() < stop_at:
                kv_samples.append(srv.metric("lmstack:kv_cache_usage_perc"))
                await asyncio.sleep(1.0)

        t0 = time.monotonic()
        await asyncio.gather(
            *(worker(i) for i in range(args.clients)),
            *(leaver(i) for i in range(args.disconnects)),
            sample_kv(),
        )
        elapsed = time.monotonic() - t0

    # Let the engine notice the last disconnects (one step) before reading the counters.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        srv.metric("lmstack:kv_cache_blocks_used") or srv.metric("lmstack:num_requests_running")
    ):
        await asyncio.sleep(0.2)
    failed = [r for r in results if r.error is not None]
    lost = [r for r in results if r.error is None and not r.ok]
    out_tokens = sum(r.tokens_received for r in results)
    return {
        "elapsed_s": elapsed,
        "requests": len(results),
        "failed": len(failed),
        "lost": len(lost),
        "failure_examples": [r.error for r in failed[:5]],
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_median_s": statistics.median(
            [r.first_token - r.start for r in results if r.first_token] or [float("nan")]
        ),
        "disconnected_clients": len(leavers),
        "disconnected_clients_received_chunks": [r.tokens_received for r in leavers],
        "aborted_counter_delta": srv.metric("lmstack:request_aborted_total") - aborted_before,
        "kv_usage_peak": max(kv_samples, default=0.0),
        "kv_blocks_used_at_end": srv.metric("lmstack:kv_cache_blocks_used"),
        "running_at_end": srv.metric("lmstack:num_requests_running"),
        "waiting_at_end": srv.metric("lmstack:num_requests_waiting"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--disconnects", type=int, default=10)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    with ServerProcess(stack(args)) as srv:
        summary = asyncio.run(run(args, srv))
    checks = {
        "no_failed": summary["failed"] == 0,
        "no_lost": summary["lost"] == 0,
        "kv_back_to_zero": summary["kv_blocks_used_at_end"] == 0,
        "nothing_running": summary["running_at_end"] == 0,
        "disconnects_aborted": summary["aborted_counter_delta"] == args.disconnects,
    }
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "config": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "checks": checks,
        "pass": all(checks.values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    quick = "" if (args.clients, args.duration, args.disconnects) == (64, 60.0, 10) else "-custom"
    path = args.out / f"http_load-{dt.date.today().isoformat()}{quick}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print("checks:", ", ".join(f"{k}={'pass' if v else 'FAIL'}" for k, v in checks.items()))
    print(f"wrote {path}")
    return 0 if record["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
