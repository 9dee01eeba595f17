"""Background work that does not slow interactive work: interactive load alone vs the same load
while a large batch runs at batch priority, and the batch's own throughput vs the offline engine.

One server (`lmstack serve`, the default stack `examples/stacks/cpu.yaml` or --stack, with
`server.batch_dir` set), three phases:

0. **The interactive rate**: --concurrency (8) closed-loop streams for a moment; the interactive
   load is then open loop, Poisson arrivals at --load (0.5) x their requests/s with at most
   --concurrency in flight (or --request-rate R). Interactive traffic arrives on its own clock
   and leaves idle time, which is what a batch is to fill; closed-loop streams (--closed-loop)
   leave none, and fall into lock-step rounds whose phase alone moves TPOT by ~40 %.
1. **Interactive alone**: `lmstack bench serve`, that load, ~200-token prompts, --output-len
   tokens each, greedy, streamed `/v1/completions`; run again after phase 2 (A B A), the
   baseline being the mean of the two.
2. **Interactive + batch**: the same load (another seed: the prefix cache must not help) while
   --batch-requests completions (2,000) run as one Batch API batch (`/v1/files` +
   `/v1/batches`; its lines run at priority BATCH_PRIORITY). Without the Batch API
   (`--no-batch-api`, or a server that lacks it) they are sent as concurrent completions with
   `priority: BATCH_PRIORITY` instead, and the JSON says so (`batch_via`). The batch is
   cancelled once the interactive load ends; the JSON records whether it was still running.
3. **Batch alone vs the offline engine**: a second batch of --batch-requests other requests on
   the quiet server (output tok/s from creating it to its completion), then the same requests
   through `LLM.generate` on the same stack in a worker process after the server is stopped.

Targets (issue 59): interactive P99 TTFT with the batch <= 1.2x alone, TPOT P50 <= 1.1x alone,
the batch alone >= 80 % of the offline engine's output tok/s.

    python benchmarks/e2e/batch_mix.py                # the recorded run (2,000-request batches)
    python benchmarks/e2e/batch_mix.py --quick        # smoke: 256-request batches, short requests

Writes benchmarks/results/batch_mix-<date>-<cpu kind>[-quick]/batch_mix.{json,png}, naming the CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from lmstack_bench.report import load_result
from lmstack_bench.toolbox import (
    BenchError,
    Server,
    die_with_parent,
    git_info,
    log,
    machine_info,
    result_dir,
    run_worker_process,
    started,
    write_json,
    write_result,
)

REPO = Path(__file__).resolve().parents[2]
LMSTACK = str(Path(sys.executable).with_name("lmstack"))
MODEL = "smollm2-135m-instruct"
BATCH_PRIORITY = 100  # lmstack.sampling_params.BATCH_PRIORITY (not imported: --help stays light)
FINAL = ("completed", "failed", "expired", "cancelled")  # a batch's end states
TARGETS = {"ttft_p99_ratio": 1.2, "tpot_p50_ratio": 1.1, "batch_vs_offline": 0.8}


# --- the workload ------------------------------------------------------------------------------


def batch_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` token-id prompts of about `length` tokens (±25 %), seeded; ids from the vocabulary's
    middle (no special tokens). Token ids make the server's and the offline engine's requests
    identical."""
    rng = random.Random(seed)
    lo, hi = max(1, round(length * 0.75)), max(1, round(length * 1.25))
    return [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def completion_body(prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    # Exactly batch_output_len tokens each, as the offline engine generates.
    n = args.batch_output_len
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
    }


# --- phase 1 and 2: the interactive load -------------------------------------------------------


def interactive(
    base: str, args: argparse.Namespace, out: Path, seed: int, requests: int | None = None
) -> tuple[dict[str, float], list[str]]:
    """One interactive phase: open loop (Poisson arrivals at --request-rate, at most
    --concurrency in flight) or, with --closed-loop, --concurrency closed-loop streams."""
    if args.closed_loop:
        load = ["--concurrency", str(args.concurrency)]
    else:
        load = ["--request-rate", f"{args.request_rate:.4g}", "--arrivals", "poisson",
                "--max-concurrency", str(args.concurrency)]  # fmt: skip
    cmd = [LMSTACK, "bench", "serve", "--base-url", base, "--model", MODEL, "--tokenizer", MODEL,
           *load, "--num-requests", str(requests or args.interactive_requests),
           "--warmup", "2", "--seed", str(seed), "--input-len", str(args.input_len),
           "--input-len-spread", "0.1", "--output-len", str(args.output_len), "--out", str(out),
           "--no-plot", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = load_result(out).runs[0].summary
    summary = {
        "ttft_p50_ms": s.ttft.median,
        "ttft_p99_ms": s.ttft.p99,
        "tpot_p50_ms": s.tpot.median,
        "tpot_p99_ms": s.tpot.p99,
        "itl_p99_ms": s.itl.p99,
        "output_tok_s": s.output_throughput,
        "request_s": s.request_throughput,
        "failed": s.failed,
    }
    return summary, cmd


class BatchJob:
    """One batch of completions running on the server: through the Batch API, or (without it)
    as `clients` concurrent low-priority completions. `progress()` is (done, total)."""

    def __init__(self, base: str, bodies: list[dict[str, Any]], via: str, clients: int) -> None:
        self.base, self.bodies, self.via = base, bodies, via
        self.started = self.ended = None
        self.output_tokens = 0
        self.failed = 0
        if via == "batch-api":
            import openai

            self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=2)
            self._start_batch()
        else:
            self._stop = threading.Event()
            self._next = 0
            self._done = 0
            self._lock = threading.Lock()
            self.started = time.monotonic()
            self._threads = [threading.Thread(target=self._client_loop, daemon=True) for _ in range(clients)]
            for t in self._threads:
                t.start()

    # Batch API
    def _start_batch(self) -> None:
        lines = [
            json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": b})
            for i, b in enumerate(self.bodies)
        ]
        f = self.client.files.create(
            file=("batch.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
        )
        self.started = time.monotonic()
        self.batch = self.client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )

    # Concurrent low-priority completions
    def _client_loop(self) -> None:
        import httpx

        with httpx.Client(base_url=self.base, timeout=600.0) as http:
            while not self._stop.is_set():
                with self._lock:
                    i = self._next
                    if i >= len(self.bodies):
                        return
                    self._next += 1
                r = http.post("/v1/completions", json={**self.bodies[i], "priority": BATCH_PRIORITY})
                with self._lock:
                    self._done += 1
                    if r.status_code == 200:
                        self.output_tokens += r.json()["usage"]["completion_tokens"]
                    else:
                        self.failed += 1
                    if self._done == len(self.bodies):
                        self.ended = time.monotonic()

    def progress(self) -> tuple[int, int, str]:
        """(lines done, lines in all, status)."""
        if self.via == "batch-api":
            self.batch = self.client.batches.retrieve(self.batch.id)
            c = self.batch.request_counts
            done = (c.completed + c.failed) if c else 0
            return done, len(self.bodies), self.batch.status
        with self._lock:
            status = "completed" if self._done == len(self.bodies) else "in_progress"
            return self._done, len(self.bodies), status

    def wait(self, timeout_s: float, poll_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            done, total, status = self.progress()
            if status in FINAL:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the batch is still {status} ({done}/{total}) after {timeout_s:.0f} s")
            time.sleep(poll_s)
        if self.via == "batch-api":
            self.ended = time.monotonic()
            if self.batch.status != "completed":
                raise BenchError(f"the batch ended {self.batch.status}")
            text = self.client.files.content(self.batch.output_file_id).text
            for line in text.splitlines():
                rec = json.loads(line)
                if rec["response"] and rec["response"]["status_code"] == 200:
                    self.output_tokens += rec["response"]["body"]["usage"]["completion_tokens"]
                else:
                    self.failed += 1
            self.failed += self.batch.request_counts.failed
        else:
            for t in self._threads:
                t.join()

    def cancel(self) -> None:
        if self.via == "batch-api":
            if self.progress()[2] not in FINAL:
                import openai

                try:
                    self.client.batches.cancel(self.batch.id)
                except openai.ConflictError:
                    pass  # it ended meanwhile
            self._wait_cancelled()
        else:
            self._stop.set()
            for t in self._threads:
                t.join()

    def _wait_cancelled(self) -> None:
        deadline = time.monotonic() + 600.0
        while self.progress()[2] not in FINAL:
            if time.monotonic() > deadline:
                raise BenchError("the batch did not end within 600 s of its cancel")
            time.sleep(0.25)


def batch_api_available() -> bool:
    try:
        from lmstack_api.config import ServerConfig

        return "batch_dir" in ServerConfig.__struct_fields__
    except ImportError:
        return False


# --- phase 3: the offline engine ---------------------------------------------------------------


def offline_worker(args: argparse.Namespace) -> None:
    """Worker: the prompts through `LLM.generate` on the stack; writes tok/s to --worker-out."""
    die_with_parent(os.getppid())
    out = Path(args.worker_out)
    try:
        from lmstack import LLM, SamplingParams

        prompts = json.loads(Path(args.worker_prompts).read_text())
        llm = LLM(yaml.safe_load(Path(args.worker_stack).read_text()))
        n = args.batch_output_len
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        t0 = time.monotonic()
        outs = llm.generate(prompts, params)
        wall = time.monotonic() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        write_json(out, {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall})
    except Exception as e:  # the parent reports it in one line
        import traceback

        write_json(out, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


# --- report ------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    from lmstack_bench.toolbox import pyplot

    plt = pyplot()
    alone, mixed = report["interactive_alone"], report["interactive_with_batch"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, title in ((axes[0], "ttft_p99_ms", "interactive TTFT P99 (ms)"),
                           (axes[1], "tpot_p50_ms", "interactive TPOT P50 (ms)")):  # fmt: skip
        ax.bar(["alone", "with batch"], [alone[key], mixed[key]], color=["#4c72b0", "#dd8452"])
        limit = TARGETS["ttft_p99_ratio" if key.startswith("ttft") else "tpot_p50_ratio"]
        ax.axhline(alone[key] * limit, color="#c44e52", ls="--", lw=1, label=f"target <= {limit}x alone")
        ax.set_title(title)
        ax.legend(fontsize=8)
    b = report["batch_alone"]
    if b:
        axes[2].bar(["batch (server)", "offline engine"], [b["server_tok_s"], b["offline_tok_s"]],
                    color=["#dd8452", "#55a868"])  # fmt: skip
        axes[2].axhline(b["offline_tok_s"] * TARGETS["batch_vs_offline"], color="#c44e52", ls="--", lw=1,
                        label="target >= 80 %")  # fmt: skip
        axes[2].legend(fontsize=8)
    axes[2].set_title("batch alone: output tok/s")
    load = (f"{report['concurrency']} closed-loop streams" if report["interactive_loop"] == "closed"
            else f"{report['request_rate']:.2f} req/s Poisson, <= {report['concurrency']} in flight")  # fmt: skip
    fig.suptitle(f"{report['machine'].get('cpu_model')}: interactive {load}, "
                 f"{report['batch_requests']}-request batch via {report['batch_via']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdict(value: float, limit: float, at_most: bool) -> str:
    ok = value <= limit if at_most else value >= limit
    return "pass" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", type=Path, default=REPO / "examples/stacks/cpu.yaml")
    ap.add_argument("--concurrency", type=int, default=8,
                    help="interactive streams: the most in flight (open loop) or the clients (--closed-loop)")  # fmt: skip
    ap.add_argument("--request-rate", type=float, default=0.0,
                    help="interactive requests/s, Poisson (default: --load x the closed-loop capacity, measured)")  # fmt: skip
    ap.add_argument("--load", type=float, default=0.5,
                    help="without --request-rate: the rate as a fraction of --concurrency streams' capacity")  # fmt: skip
    ap.add_argument("--closed-loop", action="store_true",
                    help="interactive load as --concurrency closed-loop clients (no idle time between requests)")  # fmt: skip
    ap.add_argument("--interactive-requests", type=int, default=192, help="per interactive phase")
    ap.add_argument("--input-len", type=int, default=200, help="interactive prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="interactive output tokens")
    ap.add_argument("--batch-requests", type=int, default=2000, help="requests in each batch")
    ap.add_argument("--batch-input-len", type=int, default=128)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--no-batch-api", action="store_true",
                    help="send the batch as concurrent priority-100 completions, not through /v1/batches")  # fmt: skip
    ap.add_argument("--batch-clients", type=int, default=64, help="without the Batch API: concurrent senders")
    ap.add_argument(
        "--skip-alone", action="store_true", help="skip phase 3 (batch alone vs the offline engine)"
    )
    ap.add_argument("--quick", action="store_true",
                    help="smoke: 256-request batches, 16 interactive requests, short requests")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds for the batch alone / offline run")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder (default benchmarks/results/batch_mix-<date>-<cpu kind>[-quick])")  # fmt: skip
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-stack", help=argparse.SUPPRESS)
    ap.add_argument("--worker-prompts", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        offline_worker(args)
        return 0
    if args.quick:
        args.interactive_requests, args.input_len, args.output_len = 24, 64, 16
        args.batch_requests, args.batch_input_len, args.batch_output_len = 256, 32, 16
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so no server is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    via = "batch-api" if batch_api_available() and not args.no_batch_api else "priority-completions"
    work = Path(tempfile.mkdtemp(prefix="batch_mix-"))
    base_stack = yaml.safe_load(args.stack.read_text())
    server_stack = dict(base_stack)
    if via == "batch-api":
        server_stack["server"] = {**base_stack.get("server", {}), "batch_dir": str(work / "batches")}
    stack_path = work / "stack.yaml"
    stack_path.write_text(yaml.safe_dump(server_stack))
    offline_path = work / "offline.yaml"
    offline_path.write_text(yaml.safe_dump({k: v for k, v in base_stack.items() if k != "server"}))

    from lmstack.model.source import open_model_source

    vocab = open_model_source(base_stack["model"]).tokenizer.vocab_size  # for token-id prompts
    mixed_bodies = [
        completion_body(p, args) for p in batch_prompts(args.batch_requests, args.batch_input_len, vocab, 1)
    ]
    alone_prompts = batch_prompts(args.batch_requests, args.batch_input_len, vocab, 2)

    from lmstack_api.testing import free_port

    port = free_port()
    argv = [LMSTACK, "serve", str(stack_path), "--port", str(port), "--log-level", "warning"]
    report: dict[str, Any] = {}
    with started(Server(name="lmstack", argv=argv, port=port), work / "server.log", timeout_s=600.0) as base:
        capacity: dict[str, float] = {}
        if not args.closed_loop and args.request_rate <= 0:
            # The rate: a share of what --concurrency closed-loop streams get through, so that the
            # interactive load leaves the idle capacity a batch is meant to fill.
            rate_args = argparse.Namespace(**{**vars(args), "closed_loop": True})
            capacity, _ = interactive(base, rate_args, work / "capacity.json", seed=10,
                                      requests=max(16, 3 * args.concurrency))  # fmt: skip
            args.request_rate = args.load * capacity["request_s"]
            log(f"phase 0: {args.concurrency} closed-loop streams: {capacity['request_s']:.2f} req/s; "
                f"interactive rate {args.request_rate:.2f} req/s")  # fmt: skip
        log("phase 1: interactive load alone")
        alone, bench_cmd = interactive(base, args, work / "alone.json", seed=11)
        log(f"  {json.dumps(alone)}")
        log(f"phase 2: interactive load with a {args.batch_requests}-request batch ({via})")
        job = BatchJob(base, mixed_bodies, via, args.batch_clients)
        # Let the batch get going (validated, its lines in flight) before the interactive load.
        deadline = time.monotonic() + 120.0
        while job.progress()[2] not in ("in_progress", *FINAL) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        before = job.progress()
        mixed, _ = interactive(base, args, work / "mixed.json", seed=12)
        after = job.progress()
        log(f"  {json.dumps(mixed)}; batch lines done {before[0]} -> {after[0]} of {after[1]}")
        job.cancel()
        # Alone once more (A B A): the baseline is the mean of both, so that a machine whose
        # load drifts during the run weighs on both sides alike.
        log("phase 1 again: interactive load alone")
        alone_again, _ = interactive(base, args, work / "alone2.json", seed=13)
        log(f"  {json.dumps(alone_again)}")
        runs_alone = [alone, alone_again]
        alone = {k: (alone[k] + alone_again[k]) / 2 for k in alone}
        batch_alone: dict[str, Any] = {}
        if not args.skip_alone:
            log(f"phase 3: a {args.batch_requests}-request batch alone")
            job3 = BatchJob(base, [completion_body(p, args) for p in alone_prompts], via, args.batch_clients)
            job3.wait(args.timeout)
            wall = job3.ended - job3.started
            batch_alone = {
                "server_wall_s": wall,
                "server_output_tokens": job3.output_tokens,
                "server_tok_s": job3.output_tokens / wall,
                "server_failed": job3.failed,
            }
    if not args.skip_alone:
        log("phase 3: the same requests through the offline engine (server stopped)")
        prompts_path = work / "alone_prompts.json"
        prompts_path.write_text(json.dumps(alone_prompts))
        cmd = [sys.executable, __file__, "--worker", "--worker-stack", str(offline_path),
               "--worker-prompts", str(prompts_path), "--worker-out", str(work / "offline.json"),
               "--batch-output-len", str(args.batch_output_len)]  # fmt: skip
        off = run_worker_process(cmd, work / "offline.json", "offline engine", args.timeout, args.verbose)
        batch_alone |= {
            "offline_wall_s": off["wall_s"],
            "offline_output_tokens": off["output_tokens"],
            "offline_tok_s": off["output_tok_s"],
            "server_over_offline": batch_alone["server_tok_s"] / off["output_tok_s"],
        }

    ratios = {
        "ttft_p99_ratio": mixed["ttft_p99_ms"] / alone["ttft_p99_ms"],
        "tpot_p50_ratio": mixed["tpot_p50_ms"] / alone["tpot_p50_ms"],
    }
    if batch_alone:
        ratios["batch_vs_offline"] = batch_alone["server_over_offline"]
    report = {
        "date": dt.date.today().isoformat(),
        "machine": machine_info(),
        "git": git_info(),
        "threads": os.environ.get("OMP_NUM_THREADS", "default (affinity)"),
        "stack": str(args.stack.relative_to(REPO) if args.stack.is_relative_to(REPO) else args.stack),
        "quick": args.quick,
        "concurrency": args.concurrency,
        # "open": Poisson arrivals at request_rate, at most `concurrency` in flight; "closed":
        # `concurrency` clients, each sending its next request when the last one ends.
        "interactive_loop": "closed" if args.closed_loop else "open",
        "request_rate": None if args.closed_loop else args.request_rate,
        "closed_loop_capacity": capacity or None,  # what set request_rate (--load x its req/s)
        "load_fraction": None if args.closed_loop or not capacity else args.load,
        "interactive_requests": args.interactive_requests,
        "interactive_input_len": args.input_len,
        "interactive_output_len": args.output_len,
        "batch_requests": args.batch_requests,
        "batch_input_len": args.batch_input_len,
        "batch_output_len": args.batch_output_len,
        # "batch-api": /v1/files + /v1/batches; "priority-completions": concurrent completions at
        # priority BATCH_PRIORITY (the Batch API missing or --no-batch-api).
        "batch_via": via,
        "interactive_alone": alone,  # the mean of the runs before and after phase 2
        "interactive_alone_runs": runs_alone,
        "interactive_with_batch": mixed,
        "batch_lines_done_during_phase2": {"before": before[0], "after": after[0], "total": after[1]},
        # False: the batch finished before the interactive load did, so phase 2 was partly alone.
        "batch_ran_throughout": after[2] not in FINAL and after[0] < after[1],
        "batch_alone": batch_alone,
        "ratios": ratios,
        "targets": {k: (f"<= {v}" if k != "batch_vs_offline" else f">= {v}") for k, v in TARGETS.items()},
        "verdicts": {k: verdict(ratios[k], TARGETS[k], at_most=k != "batch_vs_offline") for k in ratios},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "bench_command_phase1": bench_cmd,
    }
    out = result_dir("batch_mix", args.out, tag="quick" if args.quick else "")
    write_result(out, "batch_mix", report, plot)
    print(f"interactive TTFT P99 {alone['ttft_p99_ms']:.0f} -> {mixed['ttft_p99_ms']:.0f} ms "
          f"(x{ratios['ttft_p99_ratio']:.2f}, target <= 1.2: {report['verdicts']['ttft_p99_ratio']})")  # fmt: skip
    print(f"interactive TPOT P50 {alone['tpot_p50_ms']:.1f} -> {mixed['tpot_p50_ms']:.1f} ms "
          f"(x{ratios['tpot_p50_ratio']:.2f}, target <= 1.1: {report['verdicts']['tpot_p50_ratio']})")  # fmt: skip
    print(f"batch lines done during phase 2: {before[0]} -> {after[0]} of {after[1]} "
          f"({'ran throughout' if report['batch_ran_throughout'] else 'FINISHED EARLY'}), via {via}")  # fmt: skip
    if batch_alone:
        print(f"batch alone {batch_alone['server_tok_s']:.1f} tok/s vs offline {batch_alone['offline_tok_s']:.1f} "
              f"(x{ratios['batch_vs_offline']:.2f}, target >= 0.8: {report['verdicts']['batch_vs_offline']})")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
