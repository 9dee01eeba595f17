"""A/B of lmstack-cpu-paged's attention kernel between the sources of a git revision and the
working tree, in one process, the two versions alternating call by call.

    python benchmarks/ab/cpu_attention_ab.py --before HEAD~1 [--rounds 31] [--threads 2]

Both versions are compiled against the installed torch (`lmstack.kernels.native`, a cache folder per
source hash) and called with the same inputs: SmolLM2-135M's geometry (9 query / 3 KV heads,
head dim 64) and a Llama-8B-like one (32 / 8, 128), block size 16 with shuffled block tables, a
bf16, fp32 and scaled fp8 (e4m3) cache, for decode at batch 1 (300 and 2,000 keys) and 32
(~220 keys), a 5-row speculative verification over 1,000 keys, one 512-token prompt and 256
tokens over 1,024 cached. Each case is checked before timing: both versions must agree to fp32
rounding (relative error <= 1e-5; `bit_identical` records whether the bits are the same). Reports the median time per call and after / before; writes JSON naming the CPU and a
bar plot to benchmarks/results/cpu_attention_ab-<date>/. Machines are noisy: quote the ratios.
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
CSRC = "plugins/attention/cpu-paged/lmstack_cpu_paged/csrc"
# query heads, KV heads, head dim (Phi-3-mini's 96: not whole AVX-512 registers, the general path)
GEOMETRIES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128), "phi3": (32, 32, 96)}
BLOCK = 16
# name: (query lengths, context lengths before each sequence's queries)
CASES = {
    "decode b1 ctx300": ([1], [299]),
    "decode b1 ctx2000": ([1], [1999]),
    "decode b32 ctx~220": ([1] * 32, [200 + 2 * i for i in range(32)]),
    "verify 5 rows ctx1000": ([5], [1000]),
    "prefill 512": ([512], [0]),
    "prefill 256 over 1024": ([256], [1024]),
}
DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "fp8_e4m3": "float8_e4m3fn"}  # name: torch dtype


def build(sources: Path, version: str) -> object:
    from lmstack.kernels.native import NativeExtension

    ext = NativeExtension(
        name=f"ab_cpu_paged_{version}",
        cache_name="kernel_ab/cpu_paged",
        sources=[sources / "cpu_paged.cpp"],
        headers=[sources / "attention_impl.h"],
    )
    return ext.load()


def git_sources(rev: str, into: Path) -> Path:
    for name in ("cpu_paged.cpp", "attention_impl.h"):
        git_show(rev, f"{CSRC}/{name}", into)
    return into


def inputs(geometry: str, case: str, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    import numpy as np
    import torch

    hq, hkv, d = GEOMETRIES[geometry]
    qlens, ctxs = CASES[case]
    nbs = [(c + q + BLOCK - 1) // BLOCK for q, c in zip(qlens, ctxs, strict=True)]
    total = sum(nbs)

    def cache() -> torch.Tensor:
        return torch.randn(total, BLOCK, hkv, d, generator=gen).to(dtype)

    kc, vc = cache(), cache()
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    tables = torch.zeros(len(qlens), max(nbs), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(nbs):
        tables[b, :nb] = perm[at : at + nb]
        at += nb
    q = torch.randn(sum(qlens), hq, d, generator=gen)
    starts = torch.tensor([0, *np.cumsum(qlens).tolist()], dtype=torch.int32)
    context = torch.tensor(ctxs, dtype=torch.int32)
    scales = torch.rand(hkv, generator=gen) + 0.5 if dtype.itemsize == 1 else None
    return q, kc, vc, tables, starts, context, d**-0.5, scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision whose kernel sources are 'before'")
    ap.add_argument("--rounds", type=int, default=31, help="calls per version and case (prefill: a fifth)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--geometries", default="smollm2,llama8b")
    ap.add_argument("--dtypes", default="bfloat16,float32,fp8_e4m3")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        exts = {"before": build(git_sources(args.before, Path(tmp)), "before")}
    exts["after"] = build(ROOT / CSRC, "after")
    gen = torch.Generator().manual_seed(0)
    results = []
    for geometry in args.geometries.split(","):
        for dname in args.dtypes.split(","):
            for case in CASES:
                q, kc, vc, tables, starts, context, scale, scales = inputs(
                    geometry, case, getattr(torch, DTYPES[dname]), gen
                )

                def call(
                    ext,
                    q=q,
                    kc=kc,
                    vc=vc,
                    tables=tables,
                    starts=starts,
                    context=context,
                    scale=scale,
                    s=scales,
                ):
                    return ext.paged_attention(q, kc, vc, tables, starts, context, scale, 0, s, s, -1, 256)

                fns = {v: (lambda e=e: call(e)) for v, e in exts.items()}
                before, after = fns["before"](), fns["after"]()
                identical = torch.equal(before, after)
                # Another summation order may move the last bits; anything more is a bug.
                err = ((after - before).norm() / before.norm()).item()
                if err > 1e-5:
                    raise SystemExit(
                        f"{geometry} {dname} {case}: the versions differ (relative error {err:.2e})"
                    )
                rounds = args.rounds if not case.startswith("prefill") else max(3, args.rounds // 5)
                times = {v: [] for v in fns}
                for _ in range(rounds):
                    for v, fn in fns.items():
                        t = time.perf_counter()
                        fn()
                        times[v].append(time.perf_counter() - t)
                med = {v: statistics.median(ts) for v, ts in times.items()}
                row = {
                    "geometry": geometry,
                    "kv_dtype": dname,
                    "case": case,
                    "before_us": round(med["before"] * 1e6, 1),
                    "after_us": round(med["after"] * 1e6, 1),
                    "after_over_before": round(med["after"] / med["before"], 3),
                    "bit_identical": identical,
                    "relative_error": float(f"{err:.2e}"),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    out = args.out or result_dir("cpu_attention_ab") / "cpu_attention_ab.json"
    note = "one process, versions alternating call by call; medians; quote ratios"
    summary = ab_record(
        out, results, before=args.before, after="working tree", threads=args.threads, note=note
    )
    plot(results, out.with_suffix(".png"), summary["cpu_model"])
    print("| geometry | KV | case | before us | after us | after/before |\n|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['geometry']} | {r['kv_dtype']} | {r['case']} | {r['before_us']:.0f} | {r['after_us']:.0f} | "
            f"{r['after_over_before']:.2f} |"
        )
    print(f"wrote {out}")


def plot(results: list[dict], path: Path, cpu: str) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.3), 4.5))
    x = np.arange(len(results))
    ax.bar(x, [r["after_over_before"] for r in results], color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(
        x, [f"{r['geometry']} {r['kv_dtype']} {r['case']}" for r in results], rotation=90, fontsize=6
    )
    ax.set_ylabel("after / before (time per call; < 1: faster)")
    ax.set_title(f"cpu-paged attention, working tree vs before ({cpu})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
