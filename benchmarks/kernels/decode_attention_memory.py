"""How far one decode step's attention is from the memory limit: `cpu-paged` over a KV cache
larger than the CPU's caches, against the same work with every row in cache, and the machine's
streaming read bandwidth.

    python benchmarks/kernels/decode_attention_memory.py [--batch 32] [--block-sizes 16 64] [--pages]

One decode step of SmolLM2-135M (30 layers, 9 query heads, 3 KV heads of 64, bf16 K/V): `--batch`
sequences of 200-330 tokens (fixed seed), each layer its own cache of `--pool-tokens` tokens, the
step's blocks placed three ways:
  scattered   at random places in the pool (a server's cache after a while)
  contiguous  one sequence's blocks one after another
  in_cache    every sequence reads the same few blocks of one layer's cache (no memory traffic:
              the kernel's arithmetic alone)
With `--pages`, `scattered` and `contiguous` again over the same caches copied into 2 MiB
transparent huge pages (`lmstack.kernels.huge_pages`, as the engine allocates its host KV cache),
rows `scattered_2m` / `contiguous_2m`: what 4 KiB pages cost the reads. For each, with one thread
and with all, the median of `--reps` steps (the placements interleaved
round by round), the K/V bytes a step reads and the rate that is. Bandwidth: the roofline
calibration's read rate (`lmstack_bench.roofline.memory_read_gb_s`), one thread and all.

What the numbers say: `scattered` near `bytes / bandwidth` means the kernel streams; near
`in_cache + bytes / bandwidth` means its memory reads and its arithmetic do not overlap.
Writes JSON (the command, the CPU) and a PNG to benchmarks/results/decode_attention_memory-<date>-<kind>/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lmstack_bench.roofline import memory_read_gb_s
from lmstack_bench.toolbox import command_line, git_info, log, machine_info, pyplot, result_dir, write_result

from lmstack.kernels.huge_pages import huge_page_bytes, thp_mode, zeros_in_huge_pages

LAYERS, HQ, HKV, D = 30, 9, 3, 64  # SmolLM2-135M's attention
PLACEMENTS = ("scattered", "contiguous", "in_cache")
HUGE = ("scattered_2m", "contiguous_2m")  # --pages: the first two over huge-page copies


def read_bandwidth(threads: int) -> float:
    """Best GB/s of the roofline calibration's read with `threads` torch threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return memory_read_gb_s()[0]
    finally:
        torch.set_num_threads(before)


class Step:
    """One decode step's attention over `LAYERS` caches for one block size."""

    def __init__(self, ext: Any, batch: int, block: int, pool_tokens: int, seed: int, pages: bool) -> None:
        rng = random.Random(seed)
        self.ext = ext
        self.ctx = [rng.randint(200, 330) for _ in range(batch)]
        blocks = [(c + block - 1) // block for c in self.ctx]
        pool = max(pool_tokens // block, sum(blocks))
        self.caches = [
            (
                torch.randn(pool, block, HKV, D).to(torch.bfloat16),
                torch.randn(pool, block, HKV, D).to(torch.bfloat16),
            )
            for _ in range(LAYERS)
        ]
        # Plain torch tensors: 4 KiB pages where the host's THP mode is `madvise` (the default of
        # many distributions); the copies in huge pages as the engine's own cache is allocated.
        self.huge = []
        if pages:
            for k, v in self.caches:
                hk, hv = zeros_in_huge_pages(k.shape, k.dtype), zeros_in_huge_pages(v.shape, v.dtype)
                hk.copy_(k), hv.copy_(v)
                self.huge.append((hk, hv))
            huge = sum(huge_page_bytes(t) or 0 for pair in self.huge for t in pair)
            log(f"block {block}: huge-page copies, {huge / 2**20:.0f} MiB of them in huge pages")
        places = list(range(pool))
        rng.shuffle(places)
        width = max(blocks)
        self.tables = {name: torch.zeros(batch, width, dtype=torch.int32) for name in PLACEMENTS}
        at = 0
        for b, n in enumerate(blocks):
            self.tables["scattered"][b, :n] = torch.tensor(places[at : at + n], dtype=torch.int32)
            self.tables["contiguous"][b, :n] = torch.arange(at, at + n, dtype=torch.int32)
            self.tables["in_cache"][b, :n] = torch.arange(n, dtype=torch.int32)
            at += n
        self.query_start = torch.arange(batch + 1, dtype=torch.int32)
        self.lens = torch.tensor(self.ctx, dtype=torch.int32)
        self.q = torch.randn(batch, HQ, D)
        # What a step reads: every context token's K and V row in each layer.
        self.bytes = sum(self.ctx) * LAYERS * 2 * HKV * D * 2

    def run(self, placement: str) -> float:
        """Seconds for one step (30 layers) with the blocks placed so."""
        table = self.tables[placement.removesuffix("_2m")]
        caches = [self.caches[0]] * LAYERS if placement == "in_cache" else self.caches
        if placement in HUGE:
            caches = self.huge
        t = time.perf_counter()
        for k, v in caches:
            # (scale, no window, no fp8 scales, widest ISA, parts of 256 keys, no softcap)
            self.ext.paged_attention(
                self.q, k, v, table, self.query_start, self.lens, 0.125, 0, None, None, -1, 256, 0.0
            )
        return time.perf_counter() - t


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from lmstack_cpu_paged.build import load

    ext = load()
    all_threads = torch.get_num_threads()
    bandwidth = {"1_thread": read_bandwidth(1), "all_threads": read_bandwidth(all_threads)}
    log(f"read bandwidth: {bandwidth['1_thread']:.1f} GB/s one thread, {bandwidth['all_threads']:.1f} all")
    cells = []
    for block in args.block_sizes:
        step = Step(ext, args.batch, block, args.pool_tokens, args.seed, args.pages)
        placements = PLACEMENTS + (HUGE if args.pages else ())
        for threads in sorted({1, all_threads}, reverse=True):
            torch.set_num_threads(threads)  # the extension's OpenMP team follows torch's count
            for name in placements:
                step.run(name)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in placements}
            for _ in range(args.reps):
                for name in placements:
                    times[name].append(step.run(name))
            for name in placements:
                ms = statistics.median(times[name]) * 1e3
                cell = {"block_size": block, "threads": threads, "placement": name}
                cell.update(step_ms=round(ms, 3), bytes=step.bytes)
                if name != "in_cache":
                    cell["read_gb_s"] = round(step.bytes / ms / 1e6, 2)
                cells.append(cell)
                rate = f"  {cell['read_gb_s']:.1f} GB/s" if "read_gb_s" in cell else ""
                log(f"block {block:4d}, {threads} thread(s): {name:10s} {ms:7.2f} ms{rate}")
        torch.set_num_threads(all_threads)
        floor = step.bytes / (bandwidth["all_threads"] * 1e9)
        log(f"block {block:4d}: bytes / read bandwidth (all threads) {floor * 1e3:.2f} ms")
        del step
    return {"bandwidth_gb_s": {k: round(v, 2) for k, v in bandwidth.items()}, "cells": cells}


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    threads = max(c["threads"] for c in report["cells"])
    cells = [c for c in report["cells"] if c["threads"] == threads]
    sizes = sorted({c["block_size"] for c in cells})
    ms = {(c["block_size"], c["placement"]): c["step_ms"] for c in cells}
    for name in [n for n in PLACEMENTS + HUGE if (sizes[0], n) in ms]:
        ax.plot(sizes, [ms[size, name] for size in sizes], marker="o", label=name)
    floor = cells[0]["bytes"] / (report["bandwidth_gb_s"]["all_threads"] * 1e9) * 1e3
    ax.axhline(floor, color="k", linestyle="--", label=f"bytes / read bandwidth ({floor:.1f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.set_xlabel("KV block size (tokens)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"ms per decode step (30 layers, {threads} threads)")
    ax.set_title(
        f"cpu-paged decode attention, {report['batch']} sequences, {report['machine'].get('cpu_model')}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block-sizes", nargs="+", type=int, default=[16, 64])
    p.add_argument("--pool-tokens", type=int, default=40960, help="tokens each layer's cache holds")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pages", action="store_true", help="also the caches in 2 MiB huge pages")
    p.add_argument("--out", type=Path, default=None, help="result folder (default: benchmarks/results/...)")
    args = p.parse_args(argv)
    report = {"command": command_line(), "machine": machine_info(), "git": git_info(), "batch": args.batch}
    report["thp_mode"] = thp_mode()
    report.update(measure(args))
    path = write_result(
        result_dir("decode_attention_memory", args.out), "decode_attention_memory", report, plot
    )
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
