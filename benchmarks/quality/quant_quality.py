"""The quantization acceptance numbers (issue 11), in one run: perplexity on a held-out text of
the unquantized model and of fp8, awq g128, rtn-int4 g128, nvfp4 weights and an fp8_e4m3 KV
cache, all with fp32 compute, through the CLI (`lmstack quantize` + `lmstack eval perplexity`).

    .venv/bin/python benchmarks/quality/quant_quality.py [--model smollm2-135m-instruct] [--max-tokens N]

A method whose quantizer is not installed (or whose quantize / eval fails) is recorded as
skipped with the reason; the rest still run. Writes benchmarks/results/quant_quality-<date>-<cpu kind>/:
quant_quality.json (numbers, targets, pass/fail, CPU, the exact commands), commands.sh, a plot
(quant_quality.png, when matplotlib is installed) and each command's stderr log.

Calibration for awq and nvfp4 (both run the AWQ search): benchmarks/data/calibration_docs.txt, this project's own README.md and
docs/*.md concatenated (a snapshot: text the project ships). Held-out text:
benchmarks/data/heldout_gpl3.txt (the GNU GPL v3 text, which its licence lets anyone copy
verbatim), never seen by the calibration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmstack_bench.toolbox import result_dir, write_json

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"
HELDOUT = DATA / "heldout_gpl3.txt"
CALIBRATION = DATA / "calibration_docs.txt"

# name -> (quantize method or None, extra quant settings for eval, target: max relative increase
# vs the unquantized model or None)
# fp32 compute for the int4 folders (lmstack-awq serves them): their CPU kernels would otherwise
# multiply batches over 16 rows in bf16 on a CPU with native bf16 (the 512-token windows here).
EXACT = {"fp32_activations": "exact"}
RUNS: dict[str, tuple[str | None, dict, float | None]] = {
    "unquantized": (None, {}, None),
    "fp8": ("fp8", {}, 0.01),
    "awq-g128": ("awq", EXACT, None),  # served with lmstack-awq's default int4 g32 embedding / head
    "rtn-int4-g128": ("rtn-int4", EXACT, None),
    "nvfp4": ("nvfp4", {}, 0.15),
    "kv-fp8_e4m3": (None, {"kv_cache": "fp8_e4m3"}, 0.01),
    # The same int4 folders served with the embedding / head dense, as the folders hold them
    # (`ignore: [lm_head]`) and as transformers / vLLM serve them: AWQ at int4 group 128, what
    # issue 11's +12 % target is checked on. lmstack-awq's default holds the tied table as int4
    # g32 for the <= 0.3x size target, at a further cost (both rows are reported).
    "awq-g128-dense-head": ("awq", EXACT | {"lm_head": "dense"}, 0.12),
    "rtn-int4-g128-dense-head": ("rtn-int4", EXACT | {"lm_head": "dense"}, None),
}
CALIBRATED = ("awq", "nvfp4")  # methods whose quantize runs the AWQ search on calibration text
GROUP_SIZE = {"rtn-int4": 128}  # awq writes group 128 (its default; it takes no option)
# The quantizer that serves a folder a method wrote: rtn-int4 quantizes at load only, and its
# compressed-tensors folders are read by `awq` (what `quant: {weights: auto}` picks).
SERVE = {"rtn-int4": "awq"}


def stack_yaml(model: str, quant: dict) -> str:
    q = {"weights": "none", "kv_cache": "none"} | quant
    return (
        f"model: {model}\ndtype: float32\ndevice: cpu\n"
        "scheduler: {name: continuous, max_num_seqs: 16, max_num_batched_tokens: 2048}\n"
        "allocator: {name: paged, block_size: 16, kv_cache_memory: 1GiB}\n"
        "attention: {prefill: torch, decode: torch}\n"
        f"quant: {json.dumps(q)}\n"
    )


def run(cmd: list[str], log: Path) -> tuple[int, str]:
    with log.open("w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    return proc.returncode, proc.stdout


def installed_quantizers(lmstack: list[str]) -> set[str]:
    proc = subprocess.run([*lmstack, "plugins", "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"none"}
    return {c["name"] for c in json.loads(proc.stdout) if c["kind"] == "quantizer"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=None, help="held-out tokens to read (default: all)")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--only", nargs="*", default=None, help="run only these names")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--folders",
        default=str(Path.home() / ".cache" / "lmstack" / "quantized"),
        help="where the quantized folders are written (<model>-<method>, replaced on each run; "
        "benchmarks/e2e/quant_cpu.py reuses them)",
    )
    args = ap.parse_args()

    from lmstack.kernels.hardware import cpu_name

    out = result_dir("quant_quality", args.out)
    lmstack = [sys.executable, "-m", "lmstack.cli"]
    have = installed_quantizers(lmstack)
    work = Path(tempfile.mkdtemp(prefix="quant_quality-"))
    folders = Path(args.folders)
    folders.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    results: dict[str, dict] = {}
    commands: list[str] = []
    for name, (method, quant, target) in RUNS.items():
        if args.only and name not in args.only:
            continue
        entry: dict = {"method": method, "quant": quant, "target_rel": target}
        results[name] = entry
        if method is not None and method not in have:
            entry["skipped"] = f"quantizer {method!r} is not installed"
            print(f"{name}: skipped ({entry['skipped']})", file=sys.stderr)
            continue
        model = args.model
        started = time.perf_counter()
        base_run = name.removesuffix("-dense-head")
        if method is not None and base_run != name and base_run in written:
            model = str(written[base_run])  # reuse the folder the plain run wrote
        elif method is not None:
            folder = folders / f"{Path(args.model).name}-{method}"
            shutil.rmtree(folder, ignore_errors=True)
            written[name] = folder
            qstack = work / f"{name}-quantize.yaml"
            qstack.write_text(stack_yaml(args.model, {"weights": "none"}), encoding="utf-8")
            cmd = [*lmstack, "quantize", "--stack", str(qstack), "--method", method, "--out", str(folder)]
            if method in GROUP_SIZE:
                cmd += ["--group-size", str(GROUP_SIZE[method])]
            if method in CALIBRATED:
                cmd += ["--calibration", str(CALIBRATION), "--num-samples", str(args.num_samples)]
            commands.append(shlex.join(cmd))
            rc, _ = run(cmd, out / f"{name}-quantize.log")
            if rc != 0:
                entry["skipped"] = f"quantize failed (exit {rc}): see {name}-quantize.log"
                print(f"{name}: {entry['skipped']}", file=sys.stderr)
                continue
            entry["quantize_seconds"] = round(time.perf_counter() - started, 1)
            entry["folder_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
            model = str(folder)
        estack = work / f"{name}-eval.yaml"
        # The quantized folder is served by the quantizer that wrote it.
        weights = {"weights": SERVE.get(method, method)} if method is not None else {}
        estack.write_text(stack_yaml(model, weights | quant), encoding="utf-8")
        cmd = [*lmstack, "eval", "perplexity", "--stack", str(estack), "--text", str(HELDOUT), "--json"]
        if args.max_tokens:
            cmd += ["--max-tokens", str(args.max_tokens)]
        commands.append(shlex.join(cmd))
        rc, stdout = run(cmd, out / f"{name}-eval.log")
        if rc != 0:
            entry["skipped"] = f"eval failed (exit {rc}): see {name}-eval.log"
            print(f"{name}: {entry['skipped']}", file=sys.stderr)
            continue
        entry |= json.loads(stdout.strip().splitlines()[-1])
        print(f"{name}: perplexity {entry['perplexity']:.3f}", file=sys.stderr)

    base = results.get("unquantized", {}).get("perplexity")
    for entry in results.values():
        if base and "perplexity" in entry:
            entry["rel_increase"] = entry["perplexity"] / base - 1
            if entry["target_rel"] is not None:
                entry["meets_target"] = entry["rel_increase"] <= entry["target_rel"]
    for a, r in (("awq-g128", "rtn-int4-g128"), ("awq-g128-dense-head", "rtn-int4-g128-dense-head")):
        awq, rtn = results.get(a, {}), results.get(r, {})  # awq against rtn-int4 with the same head
        if "perplexity" in awq and "perplexity" in rtn:
            awq["better_than_rtn"] = awq["perplexity"] < rtn["perplexity"]
            if awq["target_rel"] is not None:
                awq["meets_target"] = awq.get("meets_target", False) and awq["better_than_rtn"]
    summary = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "model": args.model,
        "heldout": str(HELDOUT.relative_to(ROOT)),
        "calibration": str(CALIBRATION.relative_to(ROOT)),
        "compute": "float32",
        "note": "timings are noisy (shared machine); perplexities are deterministic",
        "results": results,
        "commands": commands,
    }
    write_json(out / "quant_quality.json", summary)
    (out / "commands.sh").write_text("\n".join(commands) + "\n", encoding="utf-8")
    _plot(results, base, out / "quant_quality.png")
    print(json.dumps({k: v.get("perplexity", v.get("skipped")) for k, v in results.items()}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _plot(results: dict[str, dict], base: float | None, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n, e in results.items() if "perplexity" in e]
    if not names:
        return
    values = [results[n]["perplexity"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, values, color=["tab:gray" if n == "unquantized" else "tab:blue" for n in names])
    for bar, name in zip(bars, names, strict=True):
        rel = results[name].get("rel_increase")
        label = f"{results[name]['perplexity']:.2f}" + (
            f"\n{rel:+.1%}" if rel is not None and name != "unquantized" else ""
        )
        ax.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
        )
    if base:
        ax.axhline(base, color="tab:gray", linestyle="--", linewidth=0.8)
    ax.set_ylabel("perplexity (held-out text, fp32 compute)")
    ax.set_title("SmolLM2-135M-Instruct: quantization quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
