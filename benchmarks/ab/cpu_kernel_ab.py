"""A/B of the CPU weight kernels (lmstack-int8's int8 matmul, lmstack-gguf's Q4_1 / Q8_0 matmuls)
between the sources of a git revision and the working tree, in one process, alternating.

    python benchmarks/ab/cpu_kernel_ab.py --before 4cc0592~1 [--rows 1,2,8] [--rounds 15] [--threads 2] \
        [--paths int8,gguf,gguf_q8,gguf_panels] [--layer-type Q4_1]

Each kernel version is compiled against the installed torch (`lmstack.kernels.native`, its own cache
folder per source hash) and run over a whole decode step's worth of weights: SmolLM2-135M's 30
layers (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) plus the LM head
576->49152, every layer its own copy, so weights stream from memory as in serving. Paths:
  int8         lmstack-int8 `int8_matmul` (int8 weights, fp32 activations)
  int8_q8      lmstack-int8 `int8_matmul_q8` (the same weights, activations rounded to int8)
  gguf         lmstack-gguf `gguf_matmul` (Q4_1 layers or `--layer-type`, Q8_0 head, fp32 activations)
  gguf_q8      lmstack-gguf `gguf_matmul_q8` (the same weights, activations rounded to int8)
  gguf_panels  lmstack-gguf `gguf_matmul_panels` (the same weights in 16-row panels, int8 activations)
(The block paths `gguf` / `gguf_q8` take Q4_0, Q4_1 and Q8_0 layers; Q5_0 / Q5_1 are panels only.)
The two versions must agree to fp32 rounding (checked first; `bit_identical` records whether
they gave the same bits). Reports the median time of a pass per
(path, rows) and after / before; the bytes a pass reads over its time (GB/s) says how close the
kernel is to the memory bandwidth. Writes JSON naming the CPU, and a bar plot, to
benchmarks/results/cpu_kernel_ab-<date>/. Machines are noisy: quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    import torch

from lmstack_bench.toolbox import ab_record, git_show, result_dir

ROOT = Path(__file__).resolve().parents[2]
GGUF_CSRC = "plugins/quant/gguf/lmstack_gguf/csrc/"
KERNELS = {  # name: (sources in the repository, headers beside them, extension module name)
    "int8": (["plugins/quant/int8/lmstack_int8/csrc/int8_matmul.cpp"], [], "ab_int8_matmul"),
    "gguf": (
        [GGUF_CSRC + "gguf_matmul.cpp", GGUF_CSRC + "kquants.cpp"],
        [GGUF_CSRC + "kquants.h"],
        "ab_gguf_matmul",
    ),
}
# Block types the layers can take (`--layer-type`; gguf-py quantizes them), the head stays Q8_0.
LAYER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out N, in K)
LAYERS, HEAD = 30, (49152, 576)


def build(kernel: str, folder: Path | None, version: str, rev: str | None = None) -> object:
    """The kernel's extension from its sources as they are at git revision `rev` (copied into
    `folder`), or in the working tree where `rev` is None."""
    from lmstack.kernels.native import NativeExtension

    sources, headers, name = KERNELS[kernel]

    def place(path: str) -> Path:
        return git_show(rev, path, folder) if rev is not None else ROOT / path

    ext = NativeExtension(
        name=f"{name}_{version}",
        cache_name=f"kernel_ab/{kernel}",
        sources=[place(p) for p in sources],
        headers=[place(p) for p in headers],
    )
    return ext.load()


def weights(seed: int, layer_type: str = "Q4_1") -> dict[str, list[tuple[torch.Tensor, int, int]]]:
    """Per path family: [(weight, type, K)] for one decode step (30 layers + head)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as GT
    from gguf import quants

    rng = np.random.default_rng(seed)
    shapes = LAYER_SHAPES * LAYERS + [HEAD]
    int8 = [(torch.randint(-127, 128, s, dtype=torch.int8), 0, s[1]) for s in shapes]
    blocks = {}
    for s in LAYER_SHAPES:
        w = rng.standard_normal(s, dtype=np.float32) * 0.05
        blocks[s] = torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GT[layer_type])))
    head = rng.standard_normal(HEAD, dtype=np.float32) * 0.05
    gguf = [(blocks[s].clone(), int(GT[layer_type]), s[1]) for s in LAYER_SHAPES * LAYERS]
    gguf.append((torch.from_numpy(np.ascontiguousarray(quants.quantize(head, GT.Q8_0))), int(GT.Q8_0), 576))
    return {"int8": int8, "gguf": gguf}


def pass_fn(ext, path: str, ws, xs, scales, isa: int = -1):
    if path in ("int8", "int8_q8"):
        fn = ext.int8_matmul_q8 if path == "int8_q8" else ext.int8_matmul
        return lambda: [fn(xs[k], w, scales[w.shape[0]]) for w, _, k in ws]
    if path == "gguf_panels":
        packed = [(ext.gguf_pack_panels(w, t, k), t, k, w.shape[0]) for w, t, k in ws]
        return lambda: [ext.gguf_matmul_panels(xs[k], p, t, n, isa) for p, t, k, n in packed]
    fn = ext.gguf_matmul_q8 if path == "gguf_q8" else ext.gguf_matmul
    return lambda: [fn(xs[k], w, t, isa) for w, t, k in ws]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision whose kernel sources are 'before'")
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="int8,gguf,gguf_q8")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--layer-type", choices=LAYER_TYPES, default="Q4_1", help="gguf paths: the layers' block type (Q4_1)"
    )
    ap.add_argument(
        "--isa", type=int, default=-1, help="gguf paths: force the kernels' ISA (1: AVX2); -1: the CPU's best"
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    paths = args.paths.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        exts = {}
        for kernel in KERNELS:
            folder = Path(tmp) / kernel
            folder.mkdir()
            exts[kernel] = {
                "before": build(kernel, folder, "before", rev=args.before),
                "after": build(kernel, None, "after"),
            }
    ws = weights(0, args.layer_type)
    scales = {n: torch.rand(n) * 0.01 for n, _ in LAYER_SHAPES + [HEAD]}
    results = []
    for path in paths:
        family = "int8" if path.startswith("int8") else "gguf"
        w = ws[family]
        nbytes = sum(t.numel() * t.element_size() for t, _, _ in w)
        for m in rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            fns = {v: pass_fn(exts[family][v], path, w, xs, scales, args.isa) for v in ("before", "after")}
            a, b = fns["before"](), fns["after"]()
            # Bit-identical unless the compiler contracted a scalar multiply-add differently.
            identical = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            # (to fp32 rounding of the output's scale: sums cancel, so near-zero outputs carry it)
            close = (
                torch.allclose(x, y, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
                for x, y in zip(a, b, strict=True)
            )
            if not all(close):
                raise SystemExit(f"{path} at {m} rows: the two versions give different results")
            times = {"before": [], "after": []}
            for _ in range(args.rounds):
                for v, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[v].append(time.perf_counter() - t)
            med = {v: statistics.median(ts) for v, ts in times.items()}
            row = {
                "path": path,
                "rows": m,
                "bytes": nbytes,
                "before_ms": round(med["before"] * 1e3, 3),
                "after_ms": round(med["after"] * 1e3, 3),
                "after_over_before": round(med["after"] / med["before"], 3),
                "before_gb_s": round(nbytes / med["before"] / 1e9, 2),
                "after_gb_s": round(nbytes / med["after"] / 1e9, 2),
                "bit_identical": identical,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    out = args.out or result_dir("cpu_kernel_ab") / "cpu_kernel_ab.json"
    note = "one process, versions alternating; medians of --rounds passes; quote ratios"
    summary = ab_record(
        out,
        results,
        before=args.before,
        after="working tree",
        threads=args.threads,
        layer_type=args.layer_type,
        note=note,
    )
    plot(results, out.with_suffix(".png"), summary["cpu_model"])
    print(
        "| path | rows | before ms | after ms | after/before | GB/s before -> after |\n|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['path']} | {r['rows']} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | "
            f"{r['after_over_before']:.2f} | {r['before_gb_s']:.1f} -> {r['after_gb_s']:.1f} |"
        )
    print(f"wrote {out}")


def plot(results: list[dict], path: Path, cpu: str) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['path']}\n{r['rows']} row(s)" for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(6, len(results) * 0.9), 4))
    ax.bar(x - 0.2, [r["before_ms"] for r in results], 0.4, label="before")
    ax.bar(x + 0.2, [r["after_ms"] for r in results], 0.4, label="after")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per decode step's weights (median)")
    ax.set_title(f"CPU weight kernels, before vs after ({cpu})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
