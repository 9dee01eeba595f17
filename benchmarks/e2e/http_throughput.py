"""Output tokens/s through HTTP streaming vs the offline engine, at the same concurrency.

The same requests (token-id prompts, fixed output length, greedy, EOS ignored) run through
(1) the in-process engine with `max_num_seqs = --concurrency`, every request submitted at once,
and (2) a `lmstack serve` process on loopback with the same stack, driven by --concurrency
streaming clients (closed loop). Runs alternate, --repeats times each; the JSON records every
run, the medians and the ratio (target: HTTP >= 90 % of offline); the PNG plots them.

    python benchmarks/e2e/http_throughput.py                      # 32 clients, 96 requests, 3 repeats
    python benchmarks/e2e/http_throughput.py --requests 16 --repeats 1 --output-tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from lmstack_bench.toolbox import machine_info, result_dir, stream_completion, write_result

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    from lmstack import LLM

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.90
WORDS = "river mountain engine garden signal market winter lantern copper harbor violin meadow".split()


def stack(args) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "bfloat16",
        "scheduler": {"name": "continuous", "max_num_seqs": args.concurrency, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
    }


def workload(args, tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(args.requests):
        words = " ".join(
            rng.choice(WORDS) for _ in range(rng.randint(args.prompt_words // 2, args.prompt_words))
        )
        prompts.append(tokenizer.encode("Write about " + words + "."))
    return prompts


def run_offline(llm: LLM, prompts, args) -> dict:
    from lmstack import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


async def run_http(base_url: str, prompts, args) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                body = {"prompt": p, "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
                results.append(await stream_completion(client, base_url, body, count_tokens=False))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    bad = [r.error or "lost" for r in results if not r.ok]
    tokens = sum(r.tokens_received for r in results)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "failed": bad,
    }


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, mode in enumerate(("offline", "http")):
        runs = [r["output_tokens_per_s"] for r in record["runs"][mode]]
        ax.scatter([i] * len(runs), runs, color="gray", zorder=3)
        ax.bar(i, record["median_tokens_per_s"][mode], color=("#4c72b0", "#dd8452")[i], width=0.6)
    ax.set_xticks([0, 1], ["offline engine", "HTTP streaming"])
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"{record['config']['concurrency']} concurrent: HTTP / offline = {record['ratio']:.2f} "
        f"(target >= {TARGET:.2f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/http_throughput-<date>-<cpu kind>[-custom])",
    )
    args = ap.parse_args()

    from lmstack import LLM
    from lmstack_api.testing import ServerProcess

    runs: dict[str, list[dict]] = {"offline": [], "http": []}
    for rep in range(args.repeats):
        llm = LLM(stack(args))
        prompts = workload(args, llm.tokenizer)
        if rep == 0:  # warm-up: first-call allocations and kernels
            run_offline(llm, prompts[:4], argparse.Namespace(**{**vars(args), "output_tokens": 4}))
        runs["offline"].append(run_offline(llm, prompts, args))
        llm.engine.shutdown()
        del llm
        gc.collect()
        with ServerProcess(stack(args)) as srv:
            asyncio.run(
                run_http(srv.base_url, prompts[:4], argparse.Namespace(**{**vars(args), "output_tokens": 4}))
            )
            runs["http"].append(asyncio.run(run_http(srv.base_url, prompts, args)))
        print(
            f"run {rep + 1}: offline {runs['offline'][-1]['output_tokens_per_s']:.1f} tok/s, "
            f"http {runs['http'][-1]['output_tokens_per_s']:.1f} tok/s",
            flush=True,
        )
    med = {m: statistics.median(r["output_tokens_per_s"] for r in runs[m]) for m in runs}
    ratio = med["http"] / med["offline"]
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),  # CPU model and AVX2 / AVX-512 / AMX flags: bf16 speed depends on them
        "config": vars(args) | {"out": str(args.out), "stack": stack(args)},
        "runs": runs,
        "median_tokens_per_s": med,
        "ratio": ratio,
        "target": f">= {TARGET}",
        "pass": ratio >= TARGET and not any(r["failed"] for r in runs["http"]),
    }
    default = (args.concurrency, args.requests, args.output_tokens, args.repeats) == (32, 96, 128, 3)
    out = result_dir("http_throughput", args.out, tag="" if default else "custom")
    write_result(out, "http_throughput", record, plot)
    print(
        f"median output tok/s: offline {med['offline']:.1f}, http {med['http']:.1f}; "
        f"ratio {ratio:.3f} (target >= {TARGET}: {'pass' if record['pass'] else 'MISS'})"
    )
    print(f"wrote {out}/http_throughput.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
