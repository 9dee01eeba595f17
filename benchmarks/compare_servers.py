"""lmstack vs llama.cpp's `llama-server` vs plain transformers, one load generator, one run.

Each server serves the same GGUF file (SmolLM2-135M-Instruct Q4_1) on loopback, alone on the
machine, one after another; `lmstack bench serve` drives each through the same closed-loop sweep
(random ~200-token prompts, exactly 128 output tokens, greedy) and the script writes
`benchmarks/results/<date>-servers.{md,json,png}` with the table, the targets and every command.

    python benchmarks/compare_servers.py                         # the recorded run (~8 min + a ~4 min first build)
    python benchmarks/compare_servers.py --quick                 # smoke: concurrency 1,4, few requests
    python benchmarks/compare_servers.py --workload shared-prefix --servers lmstack,llama.cpp \
        --concurrency 1,4 --input-len 32 --output-len 16        # prefix caches: 1,024-token shared prompts

With `--workload shared-prefix` every request is one of two --prefix-len system prompts plus a
short new question; lmstack serves `examples/stacks/prefix-cache.yaml` (the `prefix` cache) and
llama-server its per-slot prompt cache, as it ships. The report compares median TTFT.

The peers:
- **llama.cpp**: `llama-server` with `-np <max concurrency>` parallel slots (continuous batching),
  built from the `vendor/llama.cpp` source inside the `llama-cpp-python` PyPI sdist, server target
  only, ggml's AMX code disabled (it crashes on these CPUs). The build lives in a cache directory
  outside the repository (`--build-dir`); `--llama-server PATH` uses an existing binary instead.
  It runs the Q4_1 weights natively; lmstack dequantizes them to bf16.
- **transformers**: `benchmarks/peers/hf_static_server.py`, `generate` on static batches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmstack_bench.report import BenchResult, load_result, plot_cdfs, plot_sweep, result_from_json, table  # noqa: E402
from offline_throughput import git_info, machine_info  # noqa: E402

from lmstack.model.source import resolve_model_path  # noqa: E402
from lmstack_api.testing import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
LMSTACK = str(Path(PY).with_name("lmstack"))
MODEL = "smollm2-135m-instruct"
LLAMA_CPP_PYTHON = "0.3.36"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SERVERS = ("lmstack", "llama.cpp", "transformers")


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int


def run(cmd: list[str], log: Path, **kw: Any) -> None:
    print("$ " + shlex.join(cmd), file=sys.stderr)
    with log.open("a") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, **kw)


def build_llama_server(build_dir: Path, version: str, jobs: int) -> tuple[Path, list[list[str]], bool]:
    """The llama-server binary, built once from the sdist's vendored source. Returns it, the
    commands that build it (the tar extraction is done in Python between the first two), and
    whether they ran now (False: an earlier run's build was reused)."""
    binary = build_dir / "build" / "bin" / "llama-server"
    src = build_dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    download = [PY, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={version}", "-d", str(build_dir)]  # fmt: skip
    configure = [
        "cmake", "-S", str(src), "-B", str(build_dir / "build"), "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
        "-DBUILD_SHARED_LIBS=OFF",
    ]  # fmt: skip
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    build = ["cmake", "--build", str(build_dir / "build"), "--target", "llama-server", "-j", str(jobs)]
    cmds = [download, configure, build]
    if binary.is_file():
        return binary, cmds, False
    build_dir.mkdir(parents=True, exist_ok=True)
    log = build_dir / "build.log"
    run(download, log)
    with tarfile.open(build_dir / f"llama_cpp_python-{version}.tar.gz") as tar:
        tar.extractall(build_dir, filter="data")
    run(configure, log)
    run(build, log)
    return binary, cmds, True


def servers(args: argparse.Namespace, gguf: Path, llama_server: Path | None) -> Iterator[Server]:
    slots = max(args.concurrency)
    shared = args.workload == "shared-prefix"
    ctx_per_slot = args.input_len + args.output_len + 256 + (args.prefix_len if shared else 0)
    stack = "examples/stacks/prefix-cache.yaml" if shared else "examples/stacks/cpu.yaml"
    for name in args.servers:
        port = free_port()
        if name == "lmstack":
            argv = [LMSTACK, "serve", str(REPO / stack), "--port", str(port),
                    "--log-level", "warning"]  # fmt: skip
        elif name == "llama.cpp":
            assert llama_server is not None
            argv = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                    "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching",
                    "-t", str(args.threads), "-tb", str(args.threads), "--alias", MODEL]  # fmt: skip
        else:
            argv = [PY, str(REPO / "benchmarks/peers/hf_static_server.py"), "--model", str(gguf),
                    "--port", str(port), "--batch-size", str(slots)]  # fmt: skip
        yield Server(name=name, argv=argv, port=port)


@contextlib.contextmanager
def started(server: Server, log: Path, timeout_s: float) -> Iterator[str]:
    print("$ " + shlex.join(server.argv), file=sys.stderr)
    f = log.open("w")
    proc = subprocess.Popen(server.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{server.port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not healthy after {timeout_s:.0f} s; see {log}")
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        f.close()


def bench_commands(args: argparse.Namespace, server: Server, base: str, work: Path) -> list[list[str]]:
    """One `lmstack bench serve` per concurrency: each gets its own request count (enough rounds
    for a steady state at that concurrency) and its own warm-up."""
    cmds = []
    workload = ["--workload", args.workload]
    if args.workload == "shared-prefix":
        workload += ["--prefix-len", str(args.prefix_len), "--num-prefixes", "2", "--endpoint", "chat"]
    for c in args.concurrency:
        n = max(args.min_requests, args.rounds * c)
        cmds.append(
            [LMSTACK, "bench", "serve", "--base-url", base, "--model", MODEL, "--tokenizer", MODEL,
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


def targets(results: dict[str, BenchResult], workload: str = "random") -> list[dict[str, Any]]:
    if "lmstack" not in results or "llama.cpp" not in results:
        return []
    lm, ll = by_concurrency(results["lmstack"]), by_concurrency(results["llama.cpp"])
    out = []
    if workload == "shared-prefix":
        # Both serve shared prompts from a cache; the ratio is recorded, not judged.
        for c in sorted(set(lm) & set(ll)):
            if lm[c].ttft and ll[c].ttft:
                a, b = lm[c].ttft.median, ll[c].ttft.median
                out.append({"what": f"concurrency {c}: median TTFT ms, lmstack vs llama.cpp (shared prefix)",
                            "value": [a, b], "ratio": b / a, "target": "recorded", "pass": None})  # fmt: skip
        return out
    for c in (16, 32):
        if c in lm and c in ll:
            ratio = lm[c].output_throughput / ll[c].output_throughput
            out.append({"what": f"concurrency {c}: output tok/s, lmstack / llama.cpp", "value": ratio,
                        "target": ">= 3.0", "pass": ratio >= 3.0})  # fmt: skip
    if 8 in lm and 8 in ll and lm[8].ttft and ll[8].ttft:
        a, b = lm[8].ttft.p99, ll[8].ttft.p99
        out.append({"what": "concurrency 8: P99 TTFT ms, lmstack vs llama.cpp", "value": [a, b],
                    "target": "lmstack lower", "pass": a < b})  # fmt: skip
    if 1 in lm and 1 in ll and lm[1].tpot and ll[1].tpot:
        a, b = 1000.0 / lm[1].tpot.median, 1000.0 / ll[1].tpot.median
        out.append({"what": "concurrency 1: batch-1 decode tok/s (1 / median TPOT), lmstack / llama.cpp",
                    "value": a / b, "detail": [a, b], "target": "recorded", "pass": None})  # fmt: skip
    return out


def markdown(report: dict[str, Any], results: dict[str, BenchResult], stem: str) -> str:
    m = report["machine"]
    lines = [
        f"# Serving benchmark: lmstack vs llama.cpp vs transformers ({report['date'][:10]})",
        "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} CPUs usable, {m['memory_total_gib']} GiB; "
        f"load average before {report['loadavg_before'][0]:.2f}. Git {report['git']['commit']}"
        f"{' (dirty)' if report['git']['dirty'] else ''}. Model: `{report['gguf']}` (Q4_1).",
        "",
        _workload_line(report),
        "",
        "```",
        table(list(results.values())),
        "```",
        "",
        "Weights: llama.cpp computes on the Q4_1 blocks directly (about 0.6 bytes per weight read per "
        "decode step); lmstack and transformers dequantize them to bf16 at load (2 bytes per weight).",
        "",
        f"![throughput vs P99 latency]({stem}.png)  ![latency CDFs]({stem}-cdf.png)",
        "",
        "## Targets",
        "",
        "| what | value | target | result |",
        "|---|---|---|---|",
    ]
    for t in report["targets"]:
        v = t["value"]
        if isinstance(v, list):
            shown = f"{v[0]:.0f} vs {v[1]:.0f}" + (
                f" (llama.cpp / lmstack {t['ratio']:.2f}×)" if "ratio" in t else ""
            )
        else:
            shown = f"{v:.2f}×" + (
                f" ({t['detail'][0]:.1f} vs {t['detail'][1]:.1f} tok/s)" if "detail" in t else ""
            )
        result = "recorded" if t["pass"] is None else ("pass" if t["pass"] else "**MISS**")
        lines.append(f"| {t['what']} | {shown} | {t['target']} | {result} |")
    lines += ["", "## Commands", "", "```sh", report["command"], "```", ""]
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
        "--servers", default=",".join(SERVERS), help="comma-separated subset of " + ", ".join(SERVERS)
    )
    ap.add_argument("--concurrency", default="1,8,16,32", help="closed-loop sweep (default 1,8,16,32)")
    ap.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrency = rounds × concurrency")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--slo", default="ttft=2s,tpot=100ms")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server threads")
    ap.add_argument("--llama-server", type=Path, help="an existing llama-server binary (skip the build)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="sdist version to build from")
    ap.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "lmstack-bench" / "llama.cpp")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, 32 output tokens")
    ap.add_argument(
        "--replot", type=Path, metavar="REPORT.json", help="only rewrite a recorded run's .md/.png"
    )
    args = ap.parse_args()
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
    args.servers = [s.strip() for s in args.servers.split(",")]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        print(f"error: unknown server(s) {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}",
              file=sys.stderr)  # fmt: skip
        return 2

    gguf = resolve_model_path(MODEL)
    build_cmds: list[list[str]] = []
    build_s = None
    llama_server = args.llama_server
    if "llama.cpp" in args.servers and llama_server is None:
        t0 = time.monotonic()
        llama_server, build_cmds, built = build_llama_server(
            args.build_dir / args.llama_cpp_python, args.llama_cpp_python, jobs=os.cpu_count() or 2
        )
        if built:
            build_s = time.monotonic() - t0
            print(f"built {llama_server} in {build_s:.0f} s", file=sys.stderr)

    date = dt.date.today().isoformat()
    stem = f"{date}-servers" + ("-shared-prefix" if args.workload == "shared-prefix" else "")
    stem += "-quick" if args.quick else ""
    work = Path(tempfile.mkdtemp(prefix="lmstack-compare-"))
    loadavg_before = os.getloadavg()
    git = git_info()  # the tree the run started from
    results: dict[str, BenchResult] = {}
    server_cmds, bench_cmds = [], []
    for server in servers(args, gguf, llama_server):
        with started(server, work / f"{server.name}.log", args.start_timeout) as base:
            server_cmds.append(shlex.join(server.argv))
            paths = []
            for cmd in bench_commands(args, server, base, work):
                print("$ " + shlex.join(cmd), file=sys.stderr)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                bench_cmds.append(shlex.join(cmd))
                paths.append(Path(cmd[cmd.index("--out") + 1]))
            results[server.name] = merged(paths)
        print(table([results[server.name]]), file=sys.stderr)

    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "machine": machine_info(),
        "git": git,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "gguf": gguf.name,
        "workload": args.workload,
        "prefix_len": args.prefix_len,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "slo": args.slo,
        "llama_server": str(llama_server) if llama_server else None,
        "build_commands": [shlex.join(c) for c in build_cmds],
        "build_seconds": build_s,
        "server_commands": server_cmds,
        "bench_commands": bench_cmds,
        "targets": targets(results, args.workload),
        "results": {name: res.to_json() for name, res in results.items()},
    }
    write_outputs(report, results, args.out, stem)
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
        print(f"{t['what']}: {t['value']} (target {t['target']}: {t['pass']})")
    print(f"wrote {out / stem}.{{md,json,png}}")


def replot(path: Path) -> int:
    """Rewrite a recorded run's Markdown and plots from its JSON (no servers are started)."""
    report = json.loads(path.read_text())
    results = {name: result_from_json(data) for name, data in report["results"].items()}
    report["targets"] = targets(results, report.get("workload", "random"))
    report["results"] = {name: res.to_json() for name, res in results.items()}
    write_outputs(report, results, path.parent, path.stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
