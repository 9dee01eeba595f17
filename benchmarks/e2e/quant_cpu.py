"""Quantized stacks on this CPU: batch-1 decode, 32-stream throughput, resident weight bytes,
and the sequences an FP8 KV cache fits in the same `kv_cache_memory` as a bf16 one.

Stacks (each measured in its own subprocess, so timings and memory do not mix):
  unquantized      SmolLM2 in the dtype the default stack picks (`dtype: auto`: bfloat16 on a
                   CPU with native bf16, else float32), quant none
  unquantized-bf16 the same in bfloat16 (the old default)
  kv-fp8           unquantized + `quant: {kv_cache: fp8_e4m3}`
  awq, fp8, nvfp4  folders written by `lmstack quantize --method M` (made here when the
                   command and the method's plugin exist, else skipped with a note), served
                   with `model: DIR` in the default dtype
  awq-bf16         the awq folder in bfloat16 (its compact layout through torch's int4pack)

    python benchmarks/e2e/quant_cpu.py                # full run (minutes)
    python benchmarks/e2e/quant_cpu.py --quick        # smoke run
    python benchmarks/e2e/quant_cpu.py --only unquantized,kv-fp8

Measurements, per stack:
  decode_tok_s     one ~32-token prompt, --decode-tokens new tokens (EOS ignored); tokens per
                   second after the first token, median of --repeats runs
  throughput_tok_s --streams prompts (16..256 tokens, seeded) at once, --output-tokens each,
                   output tokens per second of wall time (prefill included)
  weight_bytes     bytes of every tensor the loaded model holds: parameters, buffers and what
                   its modules keep beside them (a kernel's re-laid copy, scale tables, a bf16
                   copy for batches), each storage once (a tied head counts once), counted
                   after the runs, so what a kernel builds on first use counts too
                   (weight_bytes_at_load: the same count before any request)
  scratch_bytes    the reused work buffers kernels fill per call (a layer rebuilt for prefill),
                   after the run: resident too, but not weights
  kv_blocks, kv_sequences  blocks in --kv-memory and how many --seq-len-token sequences fit
Writes quant_cpu.json + quant_cpu.png + command.txt under
benchmarks/results/quant_cpu-<date>-<cpu kind>/.
Timings on a shared machine are noisy: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import cpu_model as cpu_name
from lmstack_bench.toolbox import result_dir

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "smollm2-135m-instruct"
QUANT_METHODS = ("awq", "fp8", "nvfp4")
# awq-bf16: the awq folder in bfloat16, where lmstack-awq keeps the checkpoint's compact layout
# (torch's int4pack op) instead of re-laying it out as Q4_1 blocks for the fp32 kernels.
FOLDER_STACKS = (*QUANT_METHODS, "awq-bf16")  # served from a folder `lmstack quantize` writes
STACKS = ("unquantized", "unquantized-bf16", "kv-fp8", *FOLDER_STACKS)
TARGETS = {
    "awq_decode_vs_unquantized": (">=", 2.0),
    "awq_weights_vs_bf16": ("<=", 0.3),
    "kv_fp8_sequences_vs_bf16": (">=", 1.9),
}
WORDS = (
    "the committee met on tuesday to review the budget while rain fell over the harbour and "
    "boats returned one by one as modern processors execute several instructions in parallel"
).split()


# ---------------------------------------------------------------------------------------------
# Worker: one stack, in its own process
# ---------------------------------------------------------------------------------------------


def stack_for(name: str, model: str, folders: dict[str, str], kv_memory: str) -> dict[str, Any]:
    stack: dict[str, Any] = {
        "model": model,
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": kv_memory},
        "quant": {"weights": "none", "kv_cache": "auto"},
    }
    if name == "unquantized-bf16":
        stack["dtype"] = "bfloat16"
    elif name == "kv-fp8":
        stack["quant"]["kv_cache"] = "fp8_e4m3"
    elif name in FOLDER_STACKS:
        stack["model"] = folders[name]
        stack["quant"] = {"weights": "auto", "kv_cache": "auto"}
        if name == "awq-bf16":
            stack["dtype"] = "bfloat16"
    return stack


def run_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmstack import LLM, SamplingParams

    # The counter `lmstack check --memory` prints too.
    from lmstack.model.memory import resident_weight_bytes
    from lmstack.stack.resolve import DTYPE_NAMES

    llm = LLM(cfg["stack"])
    engine = llm.engine
    runner = engine.executor.runner
    rng = random.Random(0)
    tok = llm.tokenizer
    result: dict[str, Any] = {
        "dtype": DTYPE_NAMES[runner.dtype],
        "kv_cache_dtype": DTYPE_NAMES[runner.kv_cache_dtype],
        "weight_bytes_at_load": resident_weight_bytes(runner.model),
        "kv_blocks": engine.allocator.num_blocks,
        "kv_sequences": engine.allocator.num_blocks * engine.allocator.block_size // cfg["seq_len"],
        "torch_threads": torch.get_num_threads(),
    }
    prompt = tok.encode(" ".join(rng.choice(WORDS) for _ in range(32)))[:32]
    n = cfg["decode_tokens"]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    rates = []
    for _ in range(cfg["repeats"]):
        out = llm.generate([prompt], params)[0]
        m = out.metrics
        rates.append((n - 1) / (m.finished_time - m.first_token_time))
    result["decode_tok_s"] = statistics.median(rates)
    result["decode_tok_s_runs"] = rates
    prompts = [
        tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 256))))
        for _ in range(cfg["streams"])
    ]
    params = SamplingParams(max_tokens=cfg["output_tokens"], temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    result["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    from lmstack.kernels.scratch import held_bytes

    result["scratch_bytes"] = held_bytes()
    # Counted again after serving: tables or layouts a kernel builds on first use count too.
    result["weight_bytes"] = resident_weight_bytes(runner.model)
    engine.shutdown()
    return result


# ---------------------------------------------------------------------------------------------
# Parent: quantized folders, subprocesses, JSON, plot
# ---------------------------------------------------------------------------------------------


def lmstack_cli() -> list[str]:
    return [sys.executable, "-m", "lmstack.cli"]


def quantize_available(method: str) -> str | None:
    """None if `lmstack quantize --method METHOD` can run here, else why not."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    names = set(build_registry(make_plugin_manager()).names("quantizer"))
    if method not in names:
        return f"quantizer {method!r} is not installed (installed: {', '.join(sorted(names))})"
    probe = subprocess.run([*lmstack_cli(), "quantize", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "`lmstack quantize` is not available in this build"
    return None


def make_folder(method: str, model: str, root: Path) -> tuple[str | None, str | None]:
    """(folder, note): the quantized folder (made once, reused), or None and why."""
    why = quantize_available(method)
    if why is not None:
        return None, why
    out = root / f"{model}-{method}"
    if (out / "config.json").exists():
        return str(out), "reused an existing folder"
    stack = root / f"{method}-source.yaml"
    stack.write_text(json.dumps({"model": model, "dtype": "float32", "device": "cpu"}))
    cmd = [*lmstack_cli(), "quantize", "--stack", str(stack), "--method", method, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        return (
            None,
            f"`{shlex.join(cmd[2:])}` failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}",
        )
    return str(out), f"made with `lmstack {shlex.join(cmd[3:])}`"


def run_stack(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def ok(*names):
        return all(n in results and "error" not in results[n] and "skipped" not in results[n] for n in names)

    if ok("awq", "unquantized"):
        # Decode against the unquantized model in the dtype the stack picks by default.
        out["awq_decode_vs_unquantized"] = (
            results["awq"]["decode_tok_s"] / results["unquantized"]["decode_tok_s"]
        )
    if ok("awq", "unquantized-bf16"):
        out["awq_weights_vs_bf16"] = (
            results["awq"]["weight_bytes"] / results["unquantized-bf16"]["weight_bytes"]
        )
    if ok("kv-fp8", "unquantized-bf16"):
        out["kv_fp8_sequences_vs_bf16"] = (
            results["kv-fp8"]["kv_sequences"] / results["unquantized-bf16"]["kv_sequences"]
        )
    for key, value in list(out.items()):
        op, bound = TARGETS[key]
        out[key] = {
            "value": value,
            "target": f"{op} {bound}",
            "met": value >= bound if op == ">=" else value <= bound,
        }
    return out


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in STACKS if n in results and "decode_tok_s" in results[n]]
    metrics = [
        ("decode_tok_s", "batch-1 decode (tok/s)"),
        ("throughput_tok_s", "32-stream output (tok/s)"),
        ("weight_bytes", "resident weights (MB)"),
        ("kv_sequences", "sequences in the KV budget"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        vals = [results[n][key] / (1e6 if key == "weight_bytes" else 1) for n in names]
        ax.bar(names, vals, color="tab:blue")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--only", default=",".join(STACKS), help="comma-separated stacks")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--kv-memory", default="256MiB")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for kv_sequences")
    ap.add_argument("--folders", default=str(Path.home() / ".cache" / "lmstack" / "quantized"))
    ap.add_argument(
        "--attention",
        default=None,
        help="attention of every stack (e.g. auto: cpu-paged where it builds); default: the stack file's, torch",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    if args.quick:  # smaller defaults; values given on the command line still win
        for key, value in {"decode_tokens": 32, "repeats": 1, "streams": 8, "output_tokens": 16}.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    today = dt.date.today().isoformat()
    out_dir = result_dir("quant_cpu", args.out)
    root = Path(args.folders)
    root.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in args.only.split(",") if s]
    unknown = set(wanted) - set(STACKS)
    if unknown:
        ap.error(f"unknown stacks {sorted(unknown)}; choose from {', '.join(STACKS)}")
    command = "python " + shlex.join(
        [
            str(Path(sys.argv[0]).relative_to(REPO) if Path(sys.argv[0]).is_absolute() else sys.argv[0]),
            *sys.argv[1:],
        ]
    )
    results: dict[str, dict[str, Any]] = {}
    folders: dict[str, str] = {}
    for name in wanted:
        if name in FOLDER_STACKS:
            folder, note = make_folder(name.removesuffix("-bf16"), args.model, root)
            if folder is None:
                results[name] = {"skipped": note}
                print(f"{name}: skipped ({note})", flush=True)
                continue
            folders[name] = folder
            results[name] = {"folder_note": note}
        cfg = {
            "stack": stack_for(name, args.model, folders, args.kv_memory)
            | ({"attention": args.attention} if args.attention else {}),
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "streams": args.streams,
            "output_tokens": args.output_tokens,
            "seq_len": args.seq_len,
        }
        t0 = time.perf_counter()
        results[name] = {**results.get(name, {}), **run_stack(name, cfg), "stack": cfg["stack"]}
        results[name]["seconds"] = time.perf_counter() - t0
        r = results[name]
        if "error" in r:
            print(f"{name}: error {r['error']}", flush=True)
        else:
            print(
                f"{name}: decode {r['decode_tok_s']:.1f} tok/s, {args.streams}-stream {r['throughput_tok_s']:.1f} tok/s, "
                f"weights {r['weight_bytes'] / 1e6:.1f} MB, KV {r['kv_cache_dtype']}: {r['kv_sequences']} x "
                f"{args.seq_len}-token sequences in {args.kv_memory}",
                flush=True,
            )
    report = {
        "date": today,
        "command": command,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "model": args.model,
        "settings": {
            k: getattr(args, k)
            for k in ("decode_tokens", "repeats", "streams", "output_tokens", "kv_memory", "seq_len", "quick")
        },
        "note": "timings on a shared machine are noisy: compare ratios from this run, not absolute numbers",
        "results": results,
        "targets": ratios(results),
    }
    (out_dir / "quant_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "command.txt").write_text(command + "\n")
    plot(results, out_dir / "quant_cpu.png", f"{args.model} on {report['cpu']} ({today})")
    print(json.dumps(report["targets"], indent=1))
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
