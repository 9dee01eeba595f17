"""CPU attention kernels: the `cpu-paged` C++ plugin against the `torch` reference backend.

    OMP_NUM_THREADS=1 python benchmarks/kernels/cpu_attention.py [--threads 1] [--reps 15] [--e2e]

Kernels (one layer's attention, over a paged cache of block size 16 with shuffled blocks):
  decode   batch 1 / 8 / 32 sequences, each at context 256 / 1024 / 2048 tokens
  prefill  one 512- or 2048-token prompt, 4 prompts of 512, and a 512-token chunk over 1536
           cached tokens (the Llama-8B-like geometry: the 512 prompt and the chunk only)
in fp32 and bf16 (queries and cache in that dtype), for SmolLM2-135M's attention geometry (9 query
heads, 3 KV heads, head dim 64) and a Llama-8B-like one (32 / 8 / 128). Each cell is the median
of `--reps` calls, the two backends interleaved call by call so that load from other processes
hits both alike. Decode reuses the step's metadata memo (`meta.scratch`) as every layer after
the first does.

`--e2e` adds an end-to-end check: `examples/stacks/cpu.yaml` against the same stack with
`attention: cpu-paged` (`examples/stacks/cpu-paged.yaml`), in one process, alternating: greedy
generation of `--e2e-prompts` prompts (~200-600 tokens) with `--e2e-tokens` new tokens each, and
batch-1 decode of one such prompt; medians of `--e2e-reps` runs.

Writes JSON (the command, the CPU's name and flags, the thread count) and a PNG of the speedups
to benchmarks/results/cpu_attention-<date>-<cpu kind>/. The machine may be shared: quote ratios.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from lmstack_bench.toolbox import result_dir

REPO = Path(__file__).resolve().parents[2]
GEOMETRIES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # query heads, KV heads, head dim
BLOCK = 16
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def interleaved(calls: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each callable, run in turn rep by rep (after one warm-up)."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernel_cells(args, backends):
    import torch

    from lmstack.testing import paged_batch

    cells = []
    for geo in args.geometries:
        hq, hkv, d = GEOMETRIES[geo]
        scale = d**-0.5
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for b in args.batches:
                for ctx in args.contexts:
                    q, _, _, kc, vc, meta, _ = paged_batch(
                        [(ctx - 1, 1)] * b, hkv, hq // hkv, d, BLOCK, dtype, seed=0
                    )
                    calls = {
                        name: functools.partial(be.decode, q, kc, vc, meta, scale=scale, sliding_window=None)
                        for name, be in backends.items()
                    }
                    cells.append(
                        _cell("decode", geo, dtype_name, f"b{b} ctx{ctx}", interleaved(calls, args.reps))
                    )
            for label, spans in args.prefills[geo]:
                q, k, v, kc, vc, meta, _ = paged_batch(spans, hkv, hq // hkv, d, BLOCK, dtype, seed=0)
                calls = {
                    name: functools.partial(
                        be.prefill, q, k, v, kc, vc, meta, scale=scale, sliding_window=None
                    )
                    for name, be in backends.items()
                }
                reps = max(3, args.reps // 3)
                cells.append(_cell("prefill", geo, dtype_name, label, interleaved(calls, reps)))
    return cells


def _cell(phase, geo, dtype, label, med):
    cell = {
        "phase": phase,
        "geometry": geo,
        "dtype": dtype,
        "case": label,
        "torch_ms": med["torch"] * 1e3,
        "cpu_paged_ms": med["cpu-paged"] * 1e3,
        "speedup": med["torch"] / med["cpu-paged"],
    }
    print(
        f"{phase:7s} {geo:8s} {dtype:8s} {label:22s} torch {cell['torch_ms']:8.3f} ms  "
        f"cpu-paged {cell['cpu_paged_ms']:8.3f} ms  x{cell['speedup']:.2f}",
        flush=True,
    )
    return cell


# --- end to end ------------------------------------------------------------------------------


def e2e(args) -> dict:
    import torch

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.kernels.hardware import auto_dtype
    from lmstack.sampling_params import SamplingParams
    from lmstack.stack.config import load_stack

    stacks = {
        "torch": load_stack(REPO / "examples" / "stacks" / "cpu.yaml"),
        "cpu-paged": load_stack(REPO / "examples" / "stacks" / "cpu-paged.yaml"),
    }
    engines = {name: LLMEngine(stack) for name, stack in stacks.items()}
    rng = random.Random(0)
    vocab = 40000
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(200, 600))] for _ in range(args.e2e_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.e2e_tokens, ignore_eos=True)

    def run(engine, batch):
        for p in batch:
            engine.add_request(p, params)
        tokens, t_first = {}, None
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if t_first is None:
                    t_first = time.perf_counter()
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return time.perf_counter() - t0, t_first - t0, list(tokens.values())

    runs: dict[str, dict[str, list[float]]] = {n: {"throughput": [], "decode": []} for n in engines}
    outputs: dict[str, list] = {}
    for _ in range(args.e2e_reps):
        for name, engine in engines.items():
            wall, _, toks = run(engine, prompts)
            runs[name]["throughput"].append(sum(map(len, toks)) / wall)
            outputs[name] = toks
            wall, first, toks = run(engine, prompts[:1])
            runs[name]["decode"].append((len(toks[0]) - 1) / (wall - first))
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in runs.items()}
    result = {
        "stacks": {n: str(s.attention) for n, s in stacks.items()},
        "dtype": str(auto_dtype(torch.device("cpu")).dtype),  # the stacks' dtype: auto
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": args.e2e_tokens,
        "reps": args.e2e_reps,
        "tokens_per_s": runs,
        "median_tokens_per_s": med,
        "throughput_ratio": med["cpu-paged"]["throughput"] / med["torch"]["throughput"],
        "decode_batch1_ratio": med["cpu-paged"]["decode"] / med["torch"]["decode"],
        "greedy_tokens_identical": sorted(outputs["torch"]) == sorted(outputs["cpu-paged"]),
    }
    print(
        f"e2e: throughput cpu-paged / torch x{result['throughput_ratio']:.2f}, batch-1 decode "
        f"x{result['decode_batch1_ratio']:.2f}, greedy identical: {result['greedy_tokens_identical']}",
        flush=True,
    )
    return result


def plot(cells, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(c["phase"], c["geometry"]) for c in cells})
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, (phase, geo) in zip(axes[:, 0], groups):
        mine = [c for c in cells if c["phase"] == phase and c["geometry"] == geo]
        cases = list(dict.fromkeys(c["case"] for c in mine))
        dtypes = list(dict.fromkeys(c["dtype"] for c in mine))
        width = 0.8 / len(dtypes)
        for j, dt_name in enumerate(dtypes):
            ys = [
                next(c["speedup"] for c in mine if c["case"] == case and c["dtype"] == dt_name)
                for case in cases
            ]
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=dt_name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(
            [i + width * (len(dtypes) - 1) / 2 for i in range(len(cases))], cases, rotation=20, fontsize=8
        )
        ax.set_ylabel("torch time / cpu-paged time")
        ax.set_title(f"{phase}, {geo} geometry", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--threads", type=int, default=None, help="torch / OpenMP threads (default: OMP_NUM_THREADS or all)"
    )
    p.add_argument(
        "--reps", type=int, default=15, help="decode calls per cell (prefill: a third, at least 3)"
    )
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048])
    p.add_argument("--no-kernels", action="store_true", help="only the end-to-end check")
    p.add_argument("--e2e", action="store_true", help="also time cpu.yaml against cpu-paged.yaml end to end")
    p.add_argument("--e2e-prompts", type=int, default=16)
    p.add_argument("--e2e-tokens", type=int, default=64)
    p.add_argument("--e2e-reps", type=int, default=3)
    p.add_argument(
        "--out", default=None, help="folder (default benchmarks/results/cpu_attention-<date>-<cpu kind>)"
    )
    args = p.parse_args()

    import torch

    from lmstack.components.torch_attention import TorchAttention
    from lmstack.kernels.hardware import cpu_flags, cpu_name

    if args.threads:
        torch.set_num_threads(args.threads)
    # The torch backend's bf16 prefill is slow on a CPU without native bf16 (seconds per call
    # for the larger geometry), so that geometry times the two smaller cases only.
    small = [("prompt 512", [(0, 512)]), ("chunk 512 over 1536", [(1536, 512)])]
    args.prefills = {
        "smollm2": [small[0], ("prompt 2048", [(0, 2048)]), ("4 prompts x 512", [(0, 512)] * 4), small[1]],
        "llama8b": small,
    }

    from lmstack_cpu_paged.backend import CpuPagedAttention

    paged = CpuPagedAttention()
    isa = {2: "avx512", 1: "avx2", 0: "scalar"}[paged._ext.best_isa()]
    backends = {"torch": TorchAttention(), "cpu-paged": paged}
    out = result_dir("cpu_attention", args.out)
    flags = sorted(f for f in FLAGS_OF_INTEREST if f in cpu_flags())
    result = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_flags": flags,
        "cpu_paged_isa": isa,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "block_size": BLOCK,
        "geometries": {
            g: dict(zip(("q_heads", "kv_heads", "head_dim"), GEOMETRIES[g])) for g in args.geometries
        },
    }
    print(
        f"{result['cpu']} ({', '.join(flags)}), {result['threads']} thread(s), cpu-paged isa {isa}",
        flush=True,
    )
    if not args.no_kernels:
        with torch.inference_mode():
            result["cells"] = kernel_cells(args, backends)
        plot(
            result["cells"],
            out / "cpu_attention.png",
            f"cpu-paged vs torch attention: {result['cpu']}, {result['threads']} thread(s), {isa}",
        )
    if args.e2e:
        result["e2e"] = e2e(args)
    (out / "cpu_attention.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
