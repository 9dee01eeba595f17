"""A bounded load test of `lmstack serve` on loopback: many concurrent streaming clients for a
fixed time, plus clients that disconnect mid-stream; checks that nothing fails or is lost and
that every KV block comes back.

    python benchmarks/e2e/http_load.py                       # 64 clients, 60 s, 10 disconnecting
    python benchmarks/e2e/http_load.py --clients 8 --duration 10 --disconnects 2   # smoke
    python benchmarks/e2e/http_load.py --sigterm --disconnects 0         # SIGTERM after 60 s under load

Writes benchmarks/results/http_load-<date>-<cpu kind>[-sigterm]/http_load.json. Pass criteria (all must hold): 0 failed
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
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from lmstack_bench.toolbox import result_dir, stream_completion, write_json

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack_api.testing import ServerProcess

REPO = Path(__file__).resolve().parents[2]
WORDS = "river mountain engine garden signal market winter lantern copper harbor violin meadow".split()


def prompt(rng: random.Random) -> str:
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + "."


def stack(args) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "bfloat16",
        "scheduler": {"name": "continuous", "max_num_seqs": args.clients, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
        "server": {"max_waiting_requests": 4 * args.clients, "drain_timeout_s": 120},
    }


async def run(args, srv: ServerProcess) -> dict:
    limits = httpx.Limits(max_connections=args.clients + args.disconnects + 8)
    results: list = []
    leavers: list = []
    rejected: set[int] = set()  # clients answered 503 after SIGTERM
    kv_samples: list[float] = []
    at_sigterm: dict = {}
    stop_at = time.monotonic() + args.duration

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(i)
            # Without --sigterm: until the duration ends. With it: until the server turns us away.
            while (time.monotonic() < stop_at) if not args.sigterm else (i not in rejected):
                body = {
                    "prompt": prompt(rng),
                    "max_tokens": rng.randint(16, 128),
                    "temperature": 0.8,
                    "seed": rng.randrange(10**6),
                }
                r = await stream_completion(client, srv.base_url, body)
                if at_sigterm and r.error is not None and r.error.startswith("HTTP 503"):
                    rejected.add(i)
                else:
                    results.append(r)

        async def leaver(i: int) -> None:
            await asyncio.sleep(args.duration * (0.2 + 0.5 * i / max(1, args.disconnects)))
            body = {"prompt": prompt(random.Random(-i)), "max_tokens": 400, "ignore_eos": True}
            leavers.append(await stream_completion(client, srv.base_url, body, stop_after_chunks=5))

        async def sample_kv() -> None:
            while time.monotonic() < stop_at:
                kv_samples.append(srv.metric("lmstack:kv_cache_usage_perc"))
                await asyncio.sleep(1.0)

        async def terminate() -> None:
            await asyncio.sleep(args.duration)
            at_sigterm["running"] = srv.metric("lmstack:num_requests_running")
            at_sigterm["finished"] = len(results)
            srv.proc.send_signal(signal.SIGTERM)

        aborted_before = srv.metric("lmstack:request_aborted_total")
        t0 = time.monotonic()
        await asyncio.gather(
            *(worker(i) for i in range(args.clients)),
            *(leaver(i) for i in range(args.disconnects)),
            sample_kv(),
            *([terminate()] if args.sigterm else []),
        )
        elapsed = time.monotonic() - t0

    common = {
        "elapsed_s": elapsed,
        "requests": len(results),
        "output_tokens": sum(r.tokens_received for r in results),
        "output_tokens_per_s": sum(r.tokens_received for r in results) / elapsed,
        "ttft_median_s": statistics.median(
            [r.first_token - r.start for r in results if r.first_token] or [0.0]
        ),
        "kv_usage_peak": max(kv_samples, default=0.0),
    }
    if args.sigterm:
        bad = [r for r in results if not r.ok]
        return common | {
            "failed_or_lost": len(bad),
            "failure_examples": [r.error for r in bad[:5]],
            "requests_running_at_sigterm": at_sigterm["running"],
            "completed_after_sigterm": len(results) - at_sigterm["finished"],
            "clients_rejected_with_503": len(rejected),
            "exit_code": await asyncio.to_thread(srv.proc.wait, 120),
        }

    # Let the engine notice the last disconnects (one step) before reading the counters.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        srv.metric("lmstack:kv_cache_blocks_used") or srv.metric("lmstack:num_requests_running")
    ):
        await asyncio.sleep(0.2)
    failed = [r for r in results if r.error is not None]
    lost = [r for r in results if r.error is None and not r.ok]
    return common | {
        "failed": len(failed),
        "lost": len(lost),
        "failure_examples": [r.error for r in failed[:5]],
        "disconnected_clients": len(leavers),
        "disconnected_clients_tokens_received": [r.tokens_received for r in leavers],
        "aborted_counter_delta": srv.metric("lmstack:request_aborted_total") - aborted_before,
        "kv_blocks_used_at_end": srv.metric("lmstack:kv_cache_blocks_used"),
        "running_at_end": srv.metric("lmstack:num_requests_running"),
        "waiting_at_end": srv.metric("lmstack:num_requests_waiting"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--disconnects", type=int, default=10)
    ap.add_argument(
        "--sigterm",
        action="store_true",
        help="after --duration, SIGTERM the server under load: in-flight streams must complete, "
        "new requests get 503, the process exits 0",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/http_load-<date>-<cpu kind>[-sigterm][-custom])",
    )
    args = ap.parse_args()

    from lmstack_api.testing import ServerProcess

    with ServerProcess(stack(args)) as srv:
        summary = asyncio.run(run(args, srv))
    if args.sigterm:
        checks = {
            "in_flight_completed": summary["failed_or_lost"] == 0 and summary["completed_after_sigterm"] > 0,
            "new_requests_503": summary["clients_rejected_with_503"] == args.clients,
            "exit_code_0": summary["exit_code"] == 0,
        }
    else:
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
    tag = "-".join(
        t
        for t in (
            "sigterm" if args.sigterm else "",
            "" if args.clients == 64 and args.duration >= 60 else "custom",
        )
        if t
    )
    path = write_json(result_dir("http_load", args.out, tag=tag) / "http_load.json", record)
    print(json.dumps(summary, indent=2))
    print("checks:", ", ".join(f"{k}={'pass' if v else 'FAIL'}" for k, v in checks.items()))
    print(f"wrote {path}")
    return 0 if record["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
