"""`lmstack tune` on the default stack, then the default and the tuned stack side by side.

Issue 58's acceptance: with a 10-minute budget on this CPU, `lmstack tune` returns a stack whose
goodput at the SLO is at least the default stack's in a follow-up comparison, both stacks in the
same run. This script runs the tuner (`lmstack tune MODEL --slo ... --budget ...`: every default,
the model alone), then serves the default stack and the tuned one in turn, each a fresh
`lmstack serve` loaded by the `lmstack bench serve` runner with the same workload, concurrency and
SLO (as `compare_servers.py` drives its stacks), alternating the two over `--rounds` rounds (the
order reversed every other round, so a busy machine's drift falls on both alike), and records
each round's goodput and tok/s, their medians and the verdict in
`benchmarks/results/tune_check-<date>-<cpu kind>[-quick]/tune_check.{json,png}` with the CPU,
the commit and the command; the tuned stack (`tuned.yaml`, its comment block naming every
candidate) and the tuner's own plot beside them.

    python benchmarks/e2e/tune_check.py                 # the recorded run: 10-minute budget (~20 min)
    python benchmarks/e2e/tune_check.py --quick --out /tmp/tune-smoke   # smoke: 2-minute budget, short loads
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from lmstack_bench.toolbox import (
    ab_order,
    command_line,
    git_info,
    log,
    machine_info,
    plot_ratios,
    result_dir,
    write_json,
)

PY = sys.executable
LMSTACK = str(Path(PY).with_name("lmstack"))
MODEL = "smollm2-135m-instruct"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL, help=f"the default stack is this model alone (default {MODEL})")
    ap.add_argument("--slo", default="ttft=2s,tpot=100ms")
    ap.add_argument("--budget", default="10m", help="the tuner's budget (default 10m)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients, tuning and comparing")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tune-duration", type=float, default=20.0, help="seconds of load per candidate")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per stack and round")
    ap.add_argument("--rounds", type=int, default=3, help="default / tuned rounds, alternating")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2-minute budget, 4 clients, 64-token prompts, 16 output tokens, short loads, 1 round")  # fmt: skip
    ap.add_argument(
        "--out", type=Path, help="folder (default benchmarks/results/tune_check-<date>-<cpu kind>)"
    )
    args = ap.parse_args()
    if args.quick:
        args.budget, args.concurrency, args.input_len, args.output_len = "2m", 4, 64, 16
        args.tune_duration, args.duration, args.rounds = 5.0, 8.0, 1

    out = result_dir("tune_check", args.out, tag="quick" if args.quick else "")
    work = Path(tempfile.mkdtemp(prefix="lmstack-tune-check-"))
    git = git_info()
    loadavg_before = os.getloadavg()
    tuned_path = out / "tuned.yaml"
    load_args = ["--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len)]  # fmt: skip
    tune_cmd = [LMSTACK, "tune", args.model, "--slo", args.slo, "--budget", args.budget, *load_args,
                "--duration", str(args.tune_duration), "--out", str(tuned_path), "--json", "--no-progress"]  # fmt: skip
    log("$ " + shlex.join(tune_cmd))
    began = time.monotonic()
    proc = subprocess.run(tune_cmd, stdout=subprocess.PIPE, text=True)
    tune_s = time.monotonic() - began
    if proc.returncode != 0 or not proc.stdout.strip():
        log(f"error: lmstack tune ended with status {proc.returncode}")
        return 1
    tune_record = json.loads(proc.stdout)

    from lmstack_bench.metrics import parse_slo
    from lmstack_bench.tune import ServerMeasure
    from lmstack_bench.tune_search import CandidateFailed
    from lmstack_bench.workloads import LengthRange, WorkloadSpec

    from lmstack.model.source import open_model_source

    stacks = {"default": {"model": args.model}, "tuned": yaml.safe_load(tuned_path.read_text())}
    measure = ServerMeasure(
        spec=WorkloadSpec(input_len=LengthRange(args.input_len), output_len=LengthRange(args.output_len)),
        tokenizer=open_model_source(args.model).tokenizer,
        slo=parse_slo(args.slo),
        concurrency=args.concurrency,
        request_rate=None,
        duration_s=args.duration,
        warmup=2,
        extra_body={},
        work_dir=work,
        progress=False,
    )
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name in ab_order(list(stacks), r):
            # A generous deadline: the comparison has no budget, only the server's own bounds.
            deadline = time.monotonic() + args.duration * 4 + 300
            try:
                m = measure(stacks[name], deadline)
            except CandidateFailed as exc:
                log(f"round {r} {name}: {exc}")
                rounds.append({"round": r, "stack": name, "error": str(exc)})
                continue
            log(f"round {r} {name}: goodput {m.goodput:.3f} req/s, {m.output_throughput:.1f} tok/s")
            rounds.append({"round": r, "stack": name, "goodput": m.goodput,
                           "output_throughput": m.output_throughput, "details": m.details})  # fmt: skip

    def med(name: str, key: str) -> float | None:
        xs = [x[key] for x in rounds if x["stack"] == name and key in x]
        return statistics.median(xs) if xs else None

    summary = {name: {"goodput": med(name, "goodput"), "output_throughput": med(name, "output_throughput")}
               for name in stacks}  # fmt: skip
    g_default, g_tuned = summary["default"]["goodput"], summary["tuned"]["goodput"]
    passed = None if g_default is None or g_tuned is None else g_tuned >= g_default
    machine = machine_info()
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "machine": machine,
        "git": git,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "quick": args.quick,
        "model": args.model,
        "slo": args.slo,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "compare_duration_s": args.duration,
        "tune": {"command": shlex.join(tune_cmd), "seconds": round(tune_s, 1), "record": tune_record},
        "tuned_stack": stacks["tuned"],
        # The tuner may keep the start stack (nothing beat it): both sides then serve one stack,
        # and their difference is the machine's noise.
        "tuned_is_default": stacks["tuned"] == stacks["default"],
        "rounds": rounds,
        "median": summary,
        "acceptance": {
            "what": "tuned goodput >= default goodput at the SLO (medians over the rounds, same run)",
            "default": g_default,
            "tuned": g_tuned,
            "pass": passed,
        },
    }
    write_json(out / "tune_check.json", report)
    if any("error" in x for x in rounds):
        log(f"kept the servers' logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if g_default and g_tuned is not None:
        ratios = {"goodput": g_tuned / g_default}
        t_default, t_tuned = summary["default"]["output_throughput"], summary["tuned"]["output_throughput"]
        if t_default and t_tuned is not None:
            ratios["output tok/s"] = t_tuned / t_default
        title = f"tuned / default: {machine['cpu_model']} ({machine['cpu_kind']}), {report['date'][:10]}"
        plot_ratios(ratios, out / "tune_check.png", title, xlabel="tuned stack over the default stack")
    print(f"CPU: {machine['cpu_model']} ({machine['cpu_kind']}, {machine['cpu_count']} cores)")
    for name, s in summary.items():
        shown = (
            "-" if s["goodput"] is None else f"{s['goodput']:.3f} req/s, {s['output_throughput']:.1f} tok/s"
        )
        print(f"{name}: median goodput {shown}")
    print(f"acceptance (tuned >= default): {passed}")
    print(f"wrote {out / 'tune_check.json'} and {tuned_path}")
    return 0 if passed is not None else 1


if __name__ == "__main__":
    sys.exit(main())
