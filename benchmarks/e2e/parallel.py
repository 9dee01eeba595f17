"""Parallel layouts: decode step time and bytes communicated per decode step, per layout.

    .venv/bin/python benchmarks/e2e/parallel.py                       # tiny model, every installed layout
    .venv/bin/python benchmarks/e2e/parallel.py --model tiny --model smollm2-135m-instruct --layouts single,tp3,pp2
    .venv/bin/python benchmarks/e2e/parallel.py --model tiny-moe --layouts single,ep2,ep2xtp2
    .venv/bin/python benchmarks/e2e/parallel.py --device cuda --dtype bfloat16   # GPU section (NCCL)

For each layout it builds an engine on the model, prefills `--batch` prompts, runs `--warmup`
decode steps, then times `--steps` decode steps (every sequence decoding one token; medians
reported). Bytes are *measured*: the ranks start with LMSTACK_COMM_STATS=1, which wraps the
torch.distributed collectives in each rank (`lmstack.testing.comm_stats`), so the count includes the
model's collectives (all-reduce, all-gather, all-to-all, send/recv) and the executor's command
broadcast (the pickled StepPlan: `broadcast`). The cost of reading the counters is measured
and subtracted. Bytes are per rank (what that rank contributes); `total` sums the ranks.

A layout the installed plugins do not provide is skipped with a note in the JSON; so is one
the model cannot be split by (the resolution error is recorded). On a CPU the ranks share the
machine's cores with each other and with the engine: with 2 cores no layout can be faster than
`single`, so the CPU section measures overhead and traffic, not speedup.

Writes `benchmarks/results/parallel-<date>-<cpu kind or gpu>/parallel.{json,png}`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Layout name -> the stack's `parallel` section. The plugin layouts follow issue 14's stack
# syntax; `replicas` is the test-only layout (full model on 2 ranks: command traffic only).
LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {"name": "single"},
    "replicas2": {"name": "replicas", "world_size": 2},
    "tp2": {"name": "tp", "tp": 2},
    "tp3": {"name": "tp", "tp": 3},
    "pp2": {"name": "pp", "pp": 2},
    "tp2xpp2": {"name": "pp", "pp": 2, "tp": 2},
    "tp3xpp2": {"name": "pp", "pp": 2, "tp": 3},
    "ep2": {"name": "ep", "ep": 2},
    "ep2xtp2": {"name": "ep", "ep": 2, "tp": 2},
}
DEFAULT_LAYOUTS = "single,replicas2,tp2,pp2,tp2xpp2,ep2,ep2xtp2"
PROMPT = "the cat sat on the mat and looked at the"


def stack_for(model: str, layout: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": model,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": 1024,
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
        "scheduler": {"name": "continuous", "max_num_seqs": args.batch, "max_num_batched_tokens": 1024},
        "parallel": dict(layout),
    }


def measure(model: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from lmstack.engine.llm import LLM
    from lmstack.errors import LmstackError
    from lmstack.sampling_params import SamplingParams
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    layout = LAYOUTS[name]
    pm = make_plugin_manager(extra_plugins=["lmstack.testing.replicas"])
    installed = build_registry(pm).names("parallel")
    if layout["name"] not in installed:
        return {
            "layout": name,
            "parallel": layout,
            "skipped": f"parallel layout {layout['name']!r} is not installed",
        }
    try:
        llm = LLM(stack_for(model, layout, args), plugin_manager=pm)
    except LmstackError as exc:
        return {"layout": name, "parallel": layout, "skipped": str(exc)}
    engine = llm.engine
    executor = engine.executor
    world = getattr(executor, "world_size", 1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 2, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"{PROMPT} {i}", params)
        while not _all_decoding(engine):
            engine.step()  # prefill (possibly chunked)
        for _ in range(args.warmup):
            engine.step()
        counted = hasattr(executor, "comm_stats")
        overhead: list[dict] = []
        if counted:
            executor.reset_comm_stats()
            overhead = executor.comm_stats()  # what reading the counters itself moves
            executor.reset_comm_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        per_rank = executor.comm_stats() if counted else [{} for _ in range(world)]
    finally:
        engine.shutdown()
    ranks = []
    for r, stats in enumerate(per_rank):
        ops = {}
        for op, v in stats.items():
            base = overhead[r].get(op, {"calls": 0, "bytes": 0}) if overhead else {"calls": 0, "bytes": 0}
            calls, nbytes = v["calls"] - base["calls"], v["bytes"] - base["bytes"]
            if calls:
                ops[op] = {"calls_per_step": calls / args.steps, "bytes_per_step": nbytes / args.steps}
        ranks.append(
            {"rank": r, "ops": ops, "bytes_per_step": sum(o["bytes_per_step"] for o in ops.values())}
        )
    return {
        "layout": name,
        "parallel": layout,
        "world_size": world,
        "batch": args.batch,
        "steps": args.steps,
        "step_s": times,
        "step_ms_median": statistics.median(times) * 1e3,
        "tokens_per_s_median": args.batch / statistics.median(times),
        "bytes_per_step_total": sum(r["bytes_per_step"] for r in ranks),
        "ranks": ranks,
    }


def _all_decoding(engine) -> bool:
    """Every request's prompt is in the KV cache and it has its first token."""
    return all(r.seqs and all(s.num_output_tokens >= 1 for s in r.seqs) for r in engine.requests.values())


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if "skipped" not in r]
    if not ran:
        return
    names = [f"{r['model_label']}\n{r['layout']}" for r in ran]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(ran) * 2), 4.5))
    a.bar(names, [r["step_ms_median"] for r in ran], color="tab:blue")
    a.set_ylabel("median decode step (ms, log)")
    a.set_yscale("log")
    b.bar(names, [r["bytes_per_step_total"] / 1024 for r in ran], color="tab:orange")
    b.set_ylabel("KiB communicated per decode step (all ranks)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        action="append",
        help="model name or path (repeatable; `tiny`, `tiny-moe`: the random-weight test models); default: tiny",
    )
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--out", default=None, help="folder (default: benchmarks/results/parallel-<date>-<cpu kind or gpu>)"
    )
    args = ap.parse_args()

    os.environ["LMSTACK_COMM_STATS"] = "1"  # inherited by every rank this process starts
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from lmstack_bench.toolbox import git_info, gpu_kind, machine_info, result_dir

    models, labels = [], {}
    for model in args.model or ["tiny"]:
        if model == "tiny":  # the random-weight test model, written now
            from lmstack.testing.tiny_model import write_tiny_model

            model = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="lmstack-bench-tiny-"))))
            labels[model] = "tiny"
        elif model == "tiny-moe":  # the random-weight mixture-of-experts test model (for ep)
            from lmstack.testing.tiny_moe import write_tiny_moe

            model = str(write_tiny_moe(Path(tempfile.mkdtemp(prefix="lmstack-bench-tiny-moe-"))))
            labels[model] = "tiny-moe"
        models.append(model)
    load_before = os.getloadavg()
    results = []
    for model in models:
        for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
            if name not in LAYOUTS:
                ap.error(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
            r = measure(model, name, args)
            r["model"] = model
            r["model_label"] = labels.get(model, Path(model).name)
            results.append(r)
            if "skipped" in r:
                print(f"{r['model_label']:>24} {name:>10}  skipped: {r['skipped']}")
            else:
                print(
                    f"{r['model_label']:>24} {name:>10}  world {r['world_size']}  step {r['step_ms_median']:8.2f} ms"
                    f"  {r['bytes_per_step_total'] / 1024:10.1f} KiB/step"
                )
    machine = machine_info()
    kind = None
    if args.device == "cuda":
        import torch

        kind = gpu_kind(torch.cuda.get_device_name(0))
    stem = result_dir("parallel", args.out, kind=kind) / "parallel"
    if args.device == "cpu":
        note = (
            f"CPU run on {machine.get('cpus_usable')} usable cores shared by every rank and the engine: "
            "parallel layouts cannot be faster than `single` here; step times show overhead, bytes show traffic. "
            "Timings are noisy when other jobs share the machine."
        )
    else:
        import torch

        note = f"GPU run (NCCL) on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    doc = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine,
        # Other jobs on the machine slow every layout alike; the load says how busy it was.
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "git": git_info(),
        "note": note,
        "bytes_counted": "per rank, tensors it contributes to each torch.distributed op (lmstack.testing.comm_stats)",
        "results": results,
    }
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    where = (
        f"{machine.get('cpu_model')}, {machine.get('cpus_usable')} cores" if args.device == "cpu" else note
    )
    plot(
        results,
        stem.with_suffix(".png"),
        f"{where}: {args.dtype}, batch {args.batch}, median of {args.steps} steps",
    )
    print(f"wrote {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
