"""Expert-parallel dispatch over gloo: the collective the `ep` layout uses (one all-reduce of the
MoE layer's output over the ep ranks; tokens replicated, no token moves) against an all-to-all
dispatch + combine (tokens sharded over the ep ranks, each token sent to the ranks holding its
top-k experts and its outputs sent back), per MoE layer and decode step.

    .venv/bin/python benchmarks/kernels/ep_dispatch.py [--ep 2] [--hidden 4096] [--top-k 2] [--tokens 1 16 256]

Bytes are what one rank sends, counted from the algorithm (ring all-reduce: 2 (ep-1)/ep of the
tensor; all-to-all: the (ep-1)/ep of its k copies per token that leave the rank, there and back,
expecting uniform routing); times are medians of wall-clock runs of the real collectives on
this machine (gloo over loopback), so they measure latency more than bandwidth. Writes
benchmarks/results/ep_dispatch-<date>-<cpu kind>/ep_dispatch.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    import torch
from lmstack_bench.toolbox import result_dir, write_json


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fn, repeats: int) -> float:
    import torch.distributed as dist

    fn()  # warm-up (gloo sets up pairs lazily)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ep)
    ep, h, k, b = args.ep, args.hidden, args.top_k, 4  # fp32
    rows = []
    for t in args.tokens:
        full = torch.randn(t, h)
        # Token-sharded alternative: this rank's t / ep tokens, k copies each, (ep-1)/ep leave it.
        mine = max(1, t // ep)
        per_peer = max(1, mine * k // ep)
        send = torch.randn(per_peer * ep, h)
        recv = torch.empty_like(send)

        def all_to_all(send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
            dist.all_to_all_single(recv, send)  # dispatch
            dist.all_to_all_single(send, recv)  # combine

        rows.append(
            {
                "tokens": t,
                "all_reduce": {
                    "bytes_per_rank": int(2 * (ep - 1) / ep * t * h * b),
                    "median_ms": _median_ms(lambda full=full: dist.all_reduce(full), args.repeats),
                },
                "all_to_all": {
                    "bytes_per_rank": int(2 * mine * k * (ep - 1) / ep * h * b),
                    "median_ms": _median_ms(all_to_all, args.repeats),
                },
            }
        )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096, help="Mixtral-8x7B: 4096")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(args.ep)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    result = {
        "command": "benchmarks/kernels/ep_dispatch.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        },
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    for r in rows:
        ar, a2a = r["all_reduce"], r["all_to_all"]
        print(
            f"T={r['tokens']:4d}  all-reduce {ar['bytes_per_rank']:>10,d} B {ar['median_ms']:7.3f} ms   "
            f"all-to-all x2 {a2a['bytes_per_rank']:>10,d} B {a2a['median_ms']:7.3f} ms"
        )
    out = write_json(result_dir("ep_dispatch") / "ep_dispatch.json", result)
    print(out)


if __name__ == "__main__":
    main()
