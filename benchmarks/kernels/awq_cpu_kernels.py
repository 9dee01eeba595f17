"""CPU int4 matmul candidates on SmolLM2-135M's linear shapes, M = 1 and 32, fp32 and bf16
activations: `_weight_int4pack_mm_for_cpu` (lmstack-awq's CPU kernel), `_weight_int8pack_mm`
(int8 weights, for comparison), dequantize + matmul (the reference kernel) and the dense
matmul. Median microseconds over `--reps` calls, torch on `--threads` threads; prints a
Markdown table. Usage: python benchmarks/kernels/awq_cpu_kernels.py [--threads 1] [--reps 30]"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from functools import partial

SHAPES = (("qkv", 576, 960), ("gate_up", 576, 3072), ("down", 1536, 576), ("head", 576, 49152))


def median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    import torch

    from lmstack.interfaces import LinearSpec
    from lmstack_awq.compact import Int8Rows
    from lmstack_awq.int4_math import Int4Scheme
    from lmstack_awq.kernels.cpu_int4pack import CpuInt4Pack
    from lmstack_awq.kernels.reference import ReferenceKernel
    from lmstack_awq.linear import Int4Linear

    torch.set_num_threads(args.threads)
    print(
        f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)"
    )
    print("| shape (in -> out) | dtype | M | int4pack | int8pack | dequant+mm | dense |")
    print("|---|---|---|---|---|---|---|")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * k**-0.5
        layer = Int4Linear(LinearSpec(k, n, False, name), Int4Scheme(128, False), "dense")
        layer.weight.weight_loader(layer.weight, w, None)
        ref = ReferenceKernel()
        packed_layer = Int4Linear(LinearSpec(k, n, False, name), Int4Scheme(128, False), "dense")
        packed_layer.weight.weight_loader(packed_layer.weight, w, None)
        int4pack = CpuInt4Pack(packed_layer)
        int8 = Int8Rows(w)
        for dtype in (torch.float32, torch.bfloat16):
            dense = w.to(dtype)
            for m in (1, 32):
                x = torch.randn(m, k).to(dtype)
                r = {
                    "int4pack": median_us(partial(int4pack, packed_layer, x), args.reps),
                    "int8pack": median_us(partial(int8.matmul, x), args.reps),
                    "dequant+mm": median_us(partial(ref, layer, x), max(3, args.reps // 5)),
                    "dense": median_us(partial(torch.matmul, x, dense.t()), args.reps),
                }
                cells = " | ".join(f"{v:.0f}" for v in r.values())
                print(
                    f"| {name} ({k} -> {n}) | {str(dtype).removeprefix('torch.')} | {m} | {cells} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
