"""What the scripts under `benchmarks/` share: the machine and commit a result names, where a
result goes and how it is written, worker and server subprocesses, a raw SSE client, the A/B
record and the batch-1 alternation. One importable module, so no script borrows another's
helpers through `sys.path`.

Imports are light on purpose: `--help` of every script must not wait for torch, so torch and
lmstack are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- the checkout, the machine, the commit --------------------------------------------------


def repo_root() -> Path:
    """The checkout the running script belongs to: the first folder above the script (then above
    the working directory) that holds `benchmarks/`. Results and `git` commands are taken there,
    wherever lmstack-bench itself is installed."""
    starts = [Path(sys.argv[0]).resolve().parent] if sys.argv and sys.argv[0] else []
    starts.append(Path.cwd().resolve())
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / "benchmarks").is_dir() and (folder / "core").is_dir():
                return folder
    return Path.cwd()


def log(msg: str) -> None:
    """Progress goes to stderr; stdout is kept for a script's summary."""
    print(msg, file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# torch's and oneDNN's own ISA caps, which a capped run sets beside LMSTACK_MAX_ISA.
TORCH_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
# Environment that changes what a run measures, recorded in front of its command when set.
RECORDED_ENV = ("LMSTACK_MAX_ISA", *TORCH_ISA_ENV)


def command_line() -> str:
    """The command as a person would retype it, recorded in every result (with the ISA caps
    of `RECORDED_ENV` in front where set: a capped run retyped without them is another run)."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RECORDED_ENV if os.environ.get(k)]
    return " ".join([*env, shlex.join(["python", *sys.argv])])


def cmd_output(cmd: list[str], cwd: Path | None = None) -> str | None:
    """A short command's stdout, or None when it is missing or fails."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=10, cwd=cwd or repo_root(), check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_flags() -> set[str]:
    """This CPU's flags as lmstack's kernels see them (empty where /proc/cpuinfo is unreadable):
    under `LMSTACK_MAX_ISA` (lmstack.kernels.hardware) without those above the cap, so the
    targets of a capped run are those of the CPU kind it stands in for."""
    from lmstack.kernels.hardware import cpu_flags as effective

    return set(effective())


def isa_cap() -> str | None:
    """`LMSTACK_MAX_ISA` where it caps the kernels (`avx2`, `scalar`), else None."""
    from lmstack.kernels.hardware import isa_cap as cap

    return cap()


def cpu_model() -> str | None:
    for line in (cmd_output(["lscpu"]) or "").splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def cpu_kind(flags: set[str] | list[str] | None = None) -> str:
    """The kind of CPU a result is filed under: `amx` (Intel Xeon with AMX), `avx512` (AVX-512
    without AMX, e.g. Zen 4 / Zen 5), `avx2` (no AVX-512), else the architecture. The kernels
    take different paths on each, so results are only comparable within a kind. This machine's
    kind under `LMSTACK_MAX_ISA` (flags None) is the capped one with `-capped` (`avx2-capped`): a
    stand-in run, filed apart from the real kind's."""
    capped = flags is None and isa_cap() is not None
    flags = set(cpu_flags() if flags is None else flags)
    if "amx_tile" in flags:
        kind = "amx"
    elif "avx512f" in flags:
        kind = "avx512"
    elif "avx2" in flags:
        kind = "avx2"
    else:
        kind = platform.machine().lower() or "cpu"
    return f"{kind}-capped" if capped else kind


def gpu_kind(device_name: str) -> str:
    """`NVIDIA H200` -> `h200`: GPU results are filed under the card's model."""
    words = device_name.replace("NVIDIA", "").split()
    return (words[0] if words else "gpu").lower()


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on: CPU model, kind and vector flags, cores, memory,
    Python, torch and its default thread count, transformers, lmstack."""
    import psutil
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    from importlib.metadata import PackageNotFoundError, version

    try:
        lm_version = version("lmstack")
    except PackageNotFoundError:
        lm_version = None
    flags = cpu_flags()
    from lmstack.kernels.hardware import cpu_description

    # Under LMSTACK_MAX_ISA: the cap and the flags the CPU itself has.
    capped = {k: v for k, v in cpu_description().items() if k in ("isa_cap", "hardware_flags")}
    return {
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2"))),
        **capped,
        **({"torch_isa_env": {k: os.environ.get(k) for k in TORCH_ISA_ENV}} if capped else {}),
        "memory_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "transformers": tf_version,
        "lmstack": lm_version,
        "hostname": platform.node(),
    }


def git_info() -> dict[str, Any]:
    """The commit measured, and whether the tree had uncommitted changes."""
    commit = cmd_output(["git", "rev-parse", "HEAD"])
    status = cmd_output(["git", "status", "--porcelain"])
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


# --- where a result goes, and how it is written ---------------------------------------------


def result_dir(script: str, out: str | Path | None = None, tag: str = "", kind: str | None = None) -> Path:
    """`out`, or `benchmarks/results/<script>-<YYYY-MM-DD>-<kind>[-<tag>]/` (kind: `cpu_kind()`),
    made. One folder per run, named so that the latest run per script and machine kind is easy
    to find and keep (see benchmarks/README.md)."""
    if out is None:
        name = f"{script}-{dt.date.today().isoformat()}-{kind or cpu_kind()}" + (f"-{tag}" if tag else "")
        out = repo_root() / "benchmarks" / "results" / name
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def write_result(
    folder: Path,
    name: str,
    report: dict[str, Any],
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> Path:
    """`<folder>/<name>.json`, then `<name>.png` drawn by `plot(report, path)`. A plotting failure
    only warns: the numbers are in the JSON already and must not be lost to it."""
    path = write_json(folder / f"{name}.json", report)
    if plot is not None:
        png = folder / f"{name}.png"
        try:
            plot(report, png)
        except Exception as e:
            log(f"warning: could not draw {png}: {type(e).__name__}: {e}")
    return path


def pyplot():
    """matplotlib's pyplot on the file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- worker subprocesses --------------------------------------------------------------------


class BenchError(Exception):
    """A benchmark step failed; the message is the one line a script prints for it."""


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM this worker when the parent dies (Linux), so none is left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def run_worker_process(
    cmd: list[str], result: Path, label: str, timeout: float, verbose: bool = False, env: dict | None = None
) -> dict[str, Any]:
    """Run one worker (a script re-invoked with its worker arguments, writing JSON to `result`),
    its output on our stderr, and return that JSON. A timeout, Ctrl-C or SIGTERM stops the
    worker; a worker's error (`{"error": ..., "traceback": ...}`) or a death without a result
    raises BenchError with one clear line."""
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, cwd=repo_root(), env=env)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label} worker ran past its timeout ({timeout:.0f}s); stopped it") from None
    finally:
        if proc.poll() is None:  # timeout, Ctrl-C or SIGTERM: stop our child by its pid
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    data: dict[str, Any] = {}
    if result.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            data = json.loads(result.read_text())
    if "error" in data:
        if verbose:
            log(data.get("traceback", ""))
        hint = "" if verbose else " (--verbose shows the worker's traceback)"
        raise BenchError(f"{label} worker failed: {data['error']}{hint}")
    if rc != 0 or not data:
        if rc < 0:
            why = f"signal {-rc}" + (" (killed: out of memory?)" if rc == -signal.SIGKILL else "")
        else:
            why = f"exit status {rc}"
        raise BenchError(f"{label} worker ended with {why} and no result")
    return data


# --- servers --------------------------------------------------------------------------------


def offline_stack(model: str, dtype: str, max_num_seqs: int) -> dict[str, Any]:
    """The stack the offline benchmarks run (offline_throughput, decode_profile): continuous
    batching, a paged 1 GiB cache, on the CPU."""
    return {
        "model": model,
        "dtype": dtype,
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
    }


@dataclass
class Server:
    """A server process to start: its name in the results, argv, loopback port, extra environment."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> str:
        """The command line as recorded: its extra environment, then argv."""
        return shlex.join([f"{k}={v}" for k, v in self.env.items()] + self.argv)


@contextlib.contextmanager
def started(server: Server, log_path: Path, timeout_s: float) -> Iterator[str]:
    """Start `server` in its own session (output to `log_path`), wait until `/health` answers,
    yield its base URL; stop its whole process group on the way out."""
    import httpx

    log("$ " + server.command())
    f = log_path.open("w")
    proc = subprocess.Popen(server.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **server.env})  # fmt: skip
    base = f"http://127.0.0.1:{server.port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not healthy after {timeout_s:.0f} s; see {log_path}")
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


# --- llama.cpp, the outside oracle -----------------------------------------------------------

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
LLAMA_TOOLS = ("llama-server", "llama-quantize", "llama-perplexity", "llama-tokenize")
# ggml's AMX code crashes on these CPUs: built without it.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BENCH_CACHE = Path.home() / ".cache" / "lmstack-bench"


def run_logged(cmd: list[str], log_path: Path, **kw: Any) -> None:
    """Run `cmd` (shown on stderr), its output appended to `log_path`; a failure raises."""
    log("$ " + shlex.join(cmd))
    with log_path.open("a") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, **kw)


# llama.cpp's own switches for the code an `LMSTACK_MAX_ISA` cap allows (GGML_NATIVE would take
# every flag of this CPU): the peer runs the same class of vector code as lmstack then.
LLAMA_CAP_FLAGS = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
    "scalar": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=OFF", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_BMI2=OFF",
               "-DGGML_FMA=OFF", "-DGGML_F16C=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
}  # fmt: skip


def llama_build_folder(build_dir: Path) -> Path:
    """Where the tools are built: `build`, or `build-avx2` / `build-scalar` under a cap."""
    cap = isa_cap()
    return build_dir / ("build" if cap is None else f"build-{cap}")


def llama_build_commands(build_dir: Path, version: str, jobs: int) -> list[list[str]]:
    """The commands that build llama.cpp's tools from the sdist in `build_dir` (the tar extraction
    is done in Python between the first two): for this CPU (GGML_NATIVE), or under
    `LMSTACK_MAX_ISA` for the capped class of CPU (`LLAMA_CAP_FLAGS`), in a folder of its own."""
    import shutil

    src = build_dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    out = llama_build_folder(build_dir)
    cap = isa_cap()
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={version}", "-d", str(build_dir)]  # fmt: skip
    configure = [
        "cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
        *(["-DGGML_NATIVE=ON"] if cap is None else LLAMA_CAP_FLAGS[cap]),
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
        "-DBUILD_SHARED_LIBS=OFF",
    ]  # fmt: skip
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    build = ["cmake", "--build", str(out), "--target", *LLAMA_TOOLS, "-j", str(jobs)]
    return [download, configure, build]


def build_llama_cpp(
    build_dir: Path, version: str, jobs: int
) -> tuple[dict[str, Path], list[list[str]], bool]:
    """llama.cpp's tools (`LLAMA_TOOLS`: the server, the quantizer, the perplexity tool and the
    tokenizer), built once from the sdist's vendored source into `build_dir` (a cache outside the
    repository). Returns {tool: binary}, the commands that build them, and whether they ran now
    (False: an earlier build had every tool; a build missing one is completed, only what is
    missing compiles). One cached build serves compare_servers.py and gguf_kquants.py."""
    import tarfile

    bins = {tool: llama_build_folder(build_dir) / "bin" / tool for tool in LLAMA_TOOLS}
    cmds = llama_build_commands(build_dir, version, jobs)
    if all(b.is_file() for b in bins.values()):
        return bins, cmds, False
    download, configure, build = cmds
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = build_dir / "build.log"
    sdist = build_dir / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        run_logged(download, log_path)
    if not (build_dir / f"llama_cpp_python-{version}").is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(build_dir, filter="data")
    run_logged(configure, log_path)
    run_logged(build, log_path)
    missing = [tool for tool, b in bins.items() if not b.is_file()]
    if missing:
        raise OSError(f"the llama.cpp build made no {', '.join(missing)}; see {log_path}")
    return bins, cmds, True


def gguf_tensor_types(path: str | Path) -> dict[str, dict[str, int]]:
    """A GGUF file's tensors by type: {"Q4_K": {"tensors": n, "bytes": b}, ...}, most bytes first
    (bytes as stored in the file)."""
    import gguf

    out: dict[str, dict[str, int]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        row = out.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += int(t.n_bytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def tensor_types_text(types: dict[str, dict[str, int]]) -> str:
    """`Q4_K 120 tensors 52.1 MB, Q6_K 31 tensors 20.3 MB, F32 61 tensors 0.1 MB`."""
    return ", ".join(
        f"{name} {row['tensors']} tensors {row['bytes'] / 1e6:.1f} MB" for name, row in types.items()
    )


@dataclass
class StreamResult:
    ok: bool = False  # ended with [DONE], no error event, usage present
    done: bool = False
    error: str | None = None
    tokens_received: int = 0  # from per-token logprobs in the chunks
    usage_completion: int | None = None
    text: str = ""
    start: float = 0.0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def usage_matches(self) -> bool:
        return self.usage_completion is not None and self.usage_completion == self.tokens_received


async def stream_completion(
    client: Any,
    base_url: str,
    body: dict,
    *,
    stop_after_chunks: int | None = None,
    count_tokens: bool = True,
) -> StreamResult:
    """POST a streamed `/v1/completions` on an `httpx.AsyncClient` and read the raw SSE until
    [DONE] (so a missing `[DONE]` or a short usage count is visible, which the `openai` package
    hides), or leave after `stop_after_chunks` chunks (a client that disconnects).
    `count_tokens` asks for logprobs=0 so every chunk lists its tokens and the usage count can
    be checked; without it (less server work, for throughput runs) the received count is taken
    from the usage chunk."""
    import httpx

    res = StreamResult(start=time.perf_counter())
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    if count_tokens:
        payload["logprobs"] = 0
    try:
        async with client.stream("POST", base_url + "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"]["message"]
                    continue
                for ch in obj.get("choices") or []:
                    res.text += ch.get("text") or ""
                    lp = ch.get("logprobs")
                    n = len(lp["tokens"]) if lp else int(not count_tokens)
                    if n:
                        now = time.perf_counter()
                        if res.first_token is None:
                            res.first_token = now
                        res.token_times.extend([now] * n)
                        res.tokens_received += n
                if obj.get("usage"):
                    res.usage_completion = obj["usage"]["completion_tokens"]
                chunks += 1
                if stop_after_chunks is not None and chunks >= stop_after_chunks:
                    break
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    if not count_tokens and res.usage_completion is not None:
        res.tokens_received = res.usage_completion
    res.ok = res.done and res.error is None and res.usage_matches
    return res


# --- A/B ------------------------------------------------------------------------------------
# Every A/B script under benchmarks/ab/ compares variants in ONE process, alternating them
# (ABBA: the order reversed every other round), so a noisy machine's drift falls on all alike,
# and writes one record (`ab_record`) naming the CPU, the command and every result.


def ab_order(names: list[str], round_index: int) -> list[str]:
    """The variants' order in round `round_index`: as given, reversed every other round."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def git_show(rev: str, path: str, into: Path) -> Path:
    """The file `path` (relative to the repository) as it is at `rev`, written into `into`."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=repo_root(), check=True, capture_output=True
    ).stdout
    out = into / Path(path).name
    out.write_bytes(text)
    return out


def ab_record(
    out: Path, results: list[dict] | dict, ratios: dict[str, float] | None = None, **fields: Any
) -> dict:
    """The A/B's record at `out`: this CPU (model, kind, flags), torch, the commit, the command
    line, the caller's `fields` (what was compared: before / after, threads, a note ...) and
    every result; with `ratios` (case -> ratio), also their bar chart beside it (`out` as .png)."""
    import torch

    flags = cpu_flags()
    summary = {
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx"))),
        "torch": torch.__version__,
        "git": git_info(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        **fields,
        "results": results,
    }
    write_json(out, summary)
    if ratios:
        title = f"{out.stem}: {summary['cpu_model']} ({summary['cpu_kind']}), {summary['date'][:10]}"
        plot_ratios(ratios, out.with_suffix(".png"), title)
    return summary


def plot_ratios(
    ratios: dict[str, float], path: Path, title: str, xlabel: str = "ratio to the first variant"
) -> None:
    """One horizontal bar per compared case, a line at 1.0: the picture every A/B record gets."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(ratios) + 1.2))
    names = list(ratios)
    ax.barh(names, [ratios[n] for n in names], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, n in enumerate(names):
        ax.text(ratios[n], i, f" {ratios[n]:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def alternate_batch1(
    llms: dict, prompts: list[list[int]], params: Any, repeats: int
) -> tuple[dict, dict, dict, dict]:
    """Each prompt alone on each `lmstack.LLM`, the systems alternating prompt by prompt (their
    order reversed every other repeat). Returns per system: decode tok/s per request ((output
    tokens - 1) / (finish - first token)), the first repeat's outputs, and the tokens and
    requests run."""
    rates: dict[str, list[float]] = {n: [] for n in llms}
    outputs: dict[str, list[list[int]]] = {n: [] for n in llms}
    generated, requests = dict.fromkeys(llms, 0), dict.fromkeys(llms, 0)
    for r in range(repeats):
        for p in prompts:
            for name in ab_order(list(llms), r):
                out = llms[name].generate([p], params)[0]
                m, n = out.metrics, len(out.token_ids)
                generated[name] += n
                requests[name] += 1
                if n > 1 and m.first_token_time is not None and m.finished_time is not None:
                    rates[name].append((n - 1) / (m.finished_time - m.first_token_time))
                if r == 0:
                    outputs[name].append(list(out.token_ids))
    return rates, outputs, generated, requests
