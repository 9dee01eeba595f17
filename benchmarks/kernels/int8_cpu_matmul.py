"""CPU matmul paths for int8 weights (one symmetric scale per output row) against the dense
linear, on SmolLM2-135M's linear shapes (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576, LM head 576->49152) at M = 1, 8, 32, 128, 512 rows.

    OMP_NUM_THREADS=1 python benchmarks/kernels/int8_cpu_matmul.py [--reps 15] [--threads 1] [--paths A,B]

Paths (W = q * scale[:, None]; q int8 [N, K], scale fp32 [N]):
  dense_fp32       F.linear(x fp32, W fp32)                  the unquantized fp32 model
  dense_bf16       F.linear(x bf16, W bf16)                  the unquantized bf16 model
  int8pack_fp32    torch.ops.aten._weight_int8pack_mm(x fp32, q, scale fp32)
  int8pack_bf16    the same op with bf16 activations and scales
  int8pack_fp16    the same op with fp16 activations and scales
  int8pack_bf16_io fp32 in / out, the op run in bf16 (x.to(bf16), result .to(fp32))
  dequant_fp32     W rebuilt in fp32 per call, then F.linear in fp32 (lmstack_int8's
                   `dequant_matmul`: slabs of at most 8 MB in a reused buffer)
  dequant_bf16     the same, the slab cast to bf16 and F.linear in bf16
  native_fp32      lmstack_int8's C++ kernel (x fp32, int8 rows widened in registers, fp32 sums)
  native_q8        its `int8_matmul_q8` (`activations: int8`: x rounded to int8 per 32 values,
                   integer dot products)

Each call uses the next of several copies of the layer (together at least `--stream-mb` of fp32
weights, 128 MB by default: more than the CPU's caches), so weights come from memory as they do
in a whole model; `--stream-mb 0` times one cache-hot copy. Medians of `--reps` calls (fewer where one call takes over a second; a cell whose first call
takes over `--skip-s` seconds is left out). Writes JSON with the CPU's name and the command to
benchmarks/results/int8_cpu_matmul-<date>-<cpu kind>/int8_cpu_matmul.json and prints a Markdown table
of each path's time relative to dense_fp32. The machine may be shared: quote ratios, not
absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    import torch

from lmstack_bench.toolbox import result_dir, write_json

SHAPES = {  # name: (in K, out N)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}
ROWS = (1, 8, 32, 64, 128, 512)
PATHS = (
    "dense_fp32",
    "dense_bf16",
    "int8pack_fp32",
    "int8pack_bf16",
    "int8pack_fp16",
    "int8pack_bf16_io",
    "dequant_fp32",
    "dequant_bf16",
    "native_fp32",
    "native_q8",
)


def make_call(path: str, copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], x: torch.Tensor):
    """A call that runs `path` on the next copy (w, q, scale) each time."""
    calls = [make_one(path, w, q, scale, x) for w, q, scale in copies]
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def make_one(path: str, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor):
    import torch
    import torch.nn.functional as F

    from lmstack_int8.kernel import dequant_matmul, native_kernel

    op = torch.ops.aten._weight_int8pack_mm
    bf16, fp16 = torch.bfloat16, torch.float16
    if path == "dense_fp32":
        return lambda: F.linear(x, w)
    if path == "dense_bf16":
        wb, xb = w.to(bf16), x.to(bf16)  # made per copy: the bf16 weights stream too
        return lambda: F.linear(xb, wb)
    if path == "int8pack_fp32":
        return lambda: op(x, q, scale)
    if path == "int8pack_bf16":
        xb, sb = x.to(bf16), scale.to(bf16)
        return lambda: op(xb, q, sb)
    if path == "int8pack_fp16":
        xh, sh = x.to(fp16), scale.to(fp16)
        return lambda: op(xh, q, sh)
    if path == "int8pack_bf16_io":
        sb = scale.to(bf16)
        return lambda: op(x.to(bf16), q, sb).float()
    if path == "dequant_fp32":
        return lambda: dequant_matmul(x, q, scale)
    if path == "dequant_bf16":
        xb = x.to(bf16)
        return lambda: dequant_matmul(xb, q, scale)
    if path in ("native_fp32", "native_q8"):
        ext = native_kernel()
        if ext is None:
            raise SystemExit(
                f"{path}: lmstack-int8's C++ kernel is not built (python -m lmstack_int8.native)"
            )
        fn = ext.int8_matmul if path == "native_fp32" else ext.int8_matmul_q8
        return lambda: fn(x, q, scale)
    raise ValueError(path)


def median_s(fn, reps: int, skip_s: float) -> float | None:
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    if first > skip_s:
        return None
    n = reps if first < 1.0 else 3
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--rows",
        type=lambda v: [int(r) for r in v.split(",")],
        default=list(ROWS),
        help="comma-separated M values",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-s", type=float, default=10.0)
    ap.add_argument("--stream-mb", type=float, default=128.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated subset (dense_fp32 always runs)"
    )
    args = ap.parse_args()

    import torch

    from lmstack.kernels.hardware import cpu_description, cpu_flags
    from lmstack_int8.kernel import quantize_rows

    paths = ["dense_fp32"] + [p for p in args.paths.split(",") if p and p != "dense_fp32"]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    with torch.no_grad():
        for name, (k, n) in SHAPES.items():
            count = max(1, min(64, int(args.stream_mb * 2**20 // (4 * n * k))))
            copies = []
            for _ in range(count):
                w = torch.randn(n, k) * k**-0.5
                copies.append((w, *quantize_rows(w)))
            for m in args.rows:
                x = torch.randn(m, k)
                for path in paths:
                    t = median_s(make_call(path, copies, x), args.reps, args.skip_s)
                    row = {
                        "shape": name,
                        "in": k,
                        "out": n,
                        "M": m,
                        "copies": count,
                        "path": path,
                        "us": None if t is None else round(t * 1e6, 1),
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
    summary = {
        "cpu": cpu_description(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "torch": torch.__version__,
        "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "reps": args.reps,
        "stream_mb": args.stream_mb,
        "command": " ".join(["python", *sys.argv]),
        "note": "shared machine: compare paths within one run (ratios), not absolute times",
        "results": results,
    }
    out = write_json(args.out or result_dir("int8_cpu_matmul") / "int8_cpu_matmul.json", summary)
    print(table(results, paths))
    print(f"wrote {out}")


def table(results: list[dict], paths: list[str]) -> str:
    """Each path's median over dense_fp32's, per shape and M (None: skipped as too slow)."""
    base = {(r["shape"], r["M"]): r["us"] for r in results if r["path"] == "dense_fp32"}
    lines = [
        "| shape | M | dense_fp32 µs | " + " | ".join(p for p in paths if p != "dense_fp32") + " |",
        "|---|---|---|" + "---|" * (len(paths) - 1),
    ]
    cells: dict[tuple[str, int], dict[str, float | None]] = {}
    for r in results:
        cells.setdefault((r["shape"], r["M"]), {})[r["path"]] = r["us"]
    for (shape, m), row in cells.items():
        ref = base[(shape, m)]
        ratios = [
            "skipped" if row.get(p) is None else f"{row[p] / ref:.2f}x" for p in paths if p != "dense_fp32"
        ]
        lines.append(f"| {shape} | {m} | {ref:.0f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
