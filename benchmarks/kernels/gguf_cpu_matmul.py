"""CPU matmul paths for GGUF-block weights (lmstack-gguf) against the dense fp32 linear, on
SmolLM2-135M's linear shapes in the encodings its GGUF uses (Q4_1 layers, the Q8_0 tied head).

    OMP_NUM_THREADS=2 python benchmarks/kernels/gguf_cpu_matmul.py [--threads 2] [--reps 15]
        [--rows 1 8 32 128] [--paths dense_fp32 bf16_copy panels ...] [--shapes qkv o ...]

Paths (W = the blocks' values):
  dense_fp32   F.linear(x fp32, W fp32): what `quant.weights: none` serves (weights dequantized at load)
  dequant      the blocks dequantized into a reused fp32 slab per call, then F.linear (lmstack-gguf
               above 32 rows, e.g. prefill)
  native       lmstack-gguf's C++ kernel on the blocks as stored (decode batches, <= 32 rows)
  native_q8    the same with `activations: int8`: x rounded to int8 per 32-block, integer dot products
  bf16_copy    F.linear(x rounded to bf16, W bf16): `prefill: dense-bf16`'s copy (native-bf16 CPUs)
  panels       `prefill: panels`: x rounded to int8 as native_q8, W re-laid out in 16-row panels
               (the CPU's best code: AVX-512 VNNI or AVX2)
  panels_avx2  the panels' AVX2 code, where the CPU also runs AVX-512 (what an AVX2-only CPU runs)

Each call uses the next of several copies of the layer (together at least `--stream-mb` MB of
fp32 weights), so weights come from memory as in a whole model. Medians of `--reps` calls.
Writes JSON naming the CPU and a plot to benchmarks/results/gguf_cpu_matmul-<date>-<cpu kind>/ and prints
each path's time relative to dense_fp32. Machines are noisy: quote ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    import torch

from lmstack_bench.toolbox import result_dir, write_json

SHAPES = {  # name: (in K, out N, encoding: a gguf.GGMLQuantizationType name)
    "qkv": (576, 960, "Q4_1"),
    "o": (576, 576, "Q4_1"),
    "gate_up": (576, 3072, "Q4_1"),
    "down": (1536, 576, "Q4_1"),
    "head": (576, 49152, "Q8_0"),
}
ROWS = (1, 8, 32, 128)
PATHS = ("dense_fp32", "dequant", "native", "native_q8", "bf16_copy", "panels", "panels_avx2")


def make_call(ext, path: str, copies: list[tuple], x: torch.Tensor, typ: int, k: int):
    """A call running `path` on the next copy (blocks, dense values, bf16 values, panels) each time."""
    import torch
    import torch.nn.functional as F

    from lmstack_gguf.kernel import dequant_matmul

    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        raw, dense, dense16, panels = copies[state["i"]]
        if path == "dense_fp32":
            return F.linear(x, dense)
        if path == "bf16_copy":
            return F.linear(x.to(torch.bfloat16), dense16).float()
        if path.startswith("panels"):
            return ext.gguf_matmul_panels(x, panels, typ, raw.shape[0], 1 if path == "panels_avx2" else -1)
        if path == "dequant":
            return dequant_matmul(x, raw, typ, k)
        if path == "native_q8":
            return ext.gguf_matmul_q8(x, raw, typ)
        return ext.gguf_matmul(x, raw, typ)

    return call


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
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream-mb", type=float, default=128.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="batch rows (M) to measure")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                    help="paths to measure (dense_fp32, the reference of the ratios, always runs)")  # fmt: skip
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = ap.parse_args()

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from lmstack.kernels.hardware import cpu_description
    from lmstack_gguf.kernel import native_kernel

    ext = native_kernel()
    if ext is None:
        raise SystemExit("lmstack-gguf's kernels are not built (python -m lmstack_gguf.native)")
    torch.set_num_threads(args.threads)
    # The panels' AVX2 code is a path of its own only where the best code is another.
    paths = [
        p
        for p in PATHS
        if (p == "dense_fp32" or p in args.paths) and (p != "panels_avx2" or ext.best_isa() > 1)
    ]
    results = []
    with torch.inference_mode():
        for name, (k, n, typ_name) in ((s, SHAPES[s]) for s in args.shapes):
            typ = GGMLQuantizationType[typ_name]
            count = max(1, min(32, int(args.stream_mb * 2**20 // (4 * n * k))))
            copies = []
            for _ in range(count):
                raw = np.ascontiguousarray(
                    quants.quantize(np.random.randn(n, k).astype(np.float32) * 0.05, typ)
                )
                dense = torch.from_numpy(quants.dequantize(raw, typ).reshape(n, k).astype(np.float32))
                panels = ext.gguf_pack_panels(torch.from_numpy(raw), int(typ), k)
                copies.append((torch.from_numpy(raw), dense, dense.to(torch.bfloat16), panels))
            for m in args.rows:
                x = torch.randn(m, k)
                for path in paths:
                    call = make_call(ext, path, copies, x, int(typ), k)
                    us = median_us(call, args.reps if m * n < 32 * 49152 else 5)
                    row = {
                        "shape": name,
                        "in": k,
                        "out": n,
                        "type": typ.name,
                        "M": m,
                        "path": path,
                        "us": round(us, 1),
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
    summary = {
        **cpu_description(),
        "torch": torch.__version__,
        "threads": args.threads,
        "command": " ".join(["python", *sys.argv]),
        "note": "compare paths within one run (ratios), not absolute times",
        "results": results,
    }
    out = write_json(args.out or result_dir("gguf_cpu_matmul") / "gguf_cpu_matmul.json", summary)
    base = {(r["shape"], r["M"]): r["us"] for r in results if r["path"] == "dense_fp32"}
    others = paths[1:]
    print(f"| shape | M | dense_fp32 µs | {' | '.join(others)} |\n|---|---|---|{'---|' * len(others)}")
    for (shape, m), ref in base.items():
        cells = {r["path"]: r["us"] for r in results if r["shape"] == shape and r["M"] == m}
        print(f"| {shape} | {m} | {ref:.0f} | " + " | ".join(f"{cells[p] / ref:.2f}x" for p in others) + " |")
    plot(results, paths, out.with_suffix(".png"), summary.get("cpu_model", "CPU"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(results: list[dict], paths: list[str], path: Path, cpu: str) -> None:
    """Per shape: each path's time over dense_fp32's against the batch rows (log scales)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in SHAPES if any(r["shape"] == s for r in results)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, shape in zip(axes, shapes, strict=True):
        ref = {r["M"]: r["us"] for r in results if r["shape"] == shape and r["path"] == "dense_fp32"}
        for p in paths[1:]:
            pts = sorted(
                (r["M"], r["us"] / ref[r["M"]]) for r in results if r["shape"] == shape and r["path"] == p
            )
            ax.plot([m for m, _ in pts], [v for _, v in pts], marker="o", label=p)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} {SHAPES[shape][1]}x{SHAPES[shape][0]}")
        ax.set_xlabel("rows (M)")
    axes[0].set_ylabel("time / dense fp32 (lower is faster)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"GGUF-block matmul paths, {cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
