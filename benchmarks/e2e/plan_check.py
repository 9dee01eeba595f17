"""`lmstack plan`'s predicted decode step times against a real run on this machine.

The prediction comes from the command itself (`lmstack plan MODEL --json`, its cached profile;
`--profile` is added when none is cached, or always with --fresh-profile). The real run then
generates in this process through the engine: at each batch size, B requests of distinct
--prompt-tokens prompts run greedily to --new-tokens tokens (EOS ignored), every step timed; the
measured step time is the mean of the decode-only steps (after every prompt is prefilled),
median over --repeats runs. Target: within 25 % of the prediction at batch 1, 8 and 32.

    .venv/bin/python benchmarks/e2e/plan_check.py                 # the tiny random-weight model
    .venv/bin/python benchmarks/e2e/plan_check.py --model smollm2-135m-instruct --fresh-profile

Writes plan_check.json (the CPU named, the commit, predictions, measurements, errors) under
benchmarks/results/plan_check-<date>-<cpu kind>/ and prints a summary. Timings on a shared
machine are noisy: a miss beside busy processes is worth a rerun before a conclusion.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import command_line, git_info, log, machine_info, result_dir, write_result

TARGET = 0.25
BATCHES = (1, 8, 32)


def tiny_model() -> str:
    """The random-weight test model, in a fixed folder so its cached profile is found again."""
    from lmstack.testing.tiny_model import write_tiny_model

    folder = Path(tempfile.gettempdir()) / "lmstack-plan-check-tiny"
    if not (folder / "config.json").exists():
        write_tiny_model(folder)
    return str(folder)


def predict(model: str, overrides: list[str], fresh: bool) -> dict[str, Any]:
    """`lmstack plan --json` (with `--profile` when asked or when nothing is cached)."""
    sets = [a for o in overrides for a in ("--set", o)]
    base = [sys.executable, "-m", "lmstack", "plan", model, *sets, "--json"]
    plan = json.loads(_run([*base, "--profile"] if fresh else base))
    if plan["profile"] is None:
        log("no cached profile for this stack: measuring one (lmstack plan --profile)")
        plan = json.loads(_run([*base, "--profile"]))
    return plan


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def measure(engine: Any, batch: int, prompt_tokens: int, new_tokens: int, rng: random.Random) -> float:
    """Mean decode-only step time of one run of `batch` requests."""
    from lmstack.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reqs = []
    for _ in range(batch):
        req = engine.make_request([rng.randrange(vocab) for _ in range(prompt_tokens)], params)
        engine.enqueue(req)
        reqs.append(req)
    seqs = [r.seqs[0] for r in reqs]
    stamps: list[float] = []
    while engine.has_unfinished():
        prefilling = any(s.num_computed_tokens < s.prompt_len for s in seqs)
        engine.step()
        now = time.perf_counter()
        if not prefilling:
            stamps.append(now)
        elif not any(s.num_computed_tokens < s.prompt_len for s in seqs):
            stamps = [now]  # the step that finished the last prompt: decode steps start here
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def plot(report: dict, out: Path) -> None:
    """Predicted and measured decode step time by batch size, the +/-25 % band around the measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    batches = [r["batch"] for r in rows]
    measured = [r["measured_step_s"] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(batches, [m * (1 - report["target"]) for m in measured],
                    [m * (1 + report["target"]) for m in measured], alpha=0.2, label="measured +/- target")  # fmt: skip
    ax.plot(batches, measured, "o-", label="measured (median)")
    ax.plot(batches, [r["predicted_step_s"] * 1e3 for r in rows], "s--", label="lmstack plan's prediction")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"plan_check: {report['model']} on {report['cpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="tiny", help="model or stack (default: tiny, the random-weight test model)"
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    p.add_argument("--fresh-profile", action="store_true", help="measure the profile again first")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (the profile's context)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/plan_check-...)")
    args = p.parse_args()
    if args.new_tokens < 3 or args.prompt_tokens < 1 or args.repeats < 1:
        p.error(
            "--new-tokens must be at least 3 (two decode steps), --prompt-tokens and --repeats at least 1"
        )

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.stack.config import load_stack
    from lmstack.stack.overrides import parse_overrides

    model = tiny_model() if args.model == "tiny" else args.model
    plan = predict(model, args.overrides, args.fresh_profile)
    predicted = {q["batch"]: q["step_s"] for q in plan["profile"]["predicted"]}
    batches = [b for b in BATCHES if b in predicted]

    engine = LLMEngine(load_stack(model, parse_overrides(args.overrides)))
    rng = random.Random(1)
    measure(engine, 1, args.prompt_tokens, 8, rng)  # warm-up
    runs: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):  # rounds over the batch sizes: a burst of load hits them alike
        for batch in batches:
            runs[batch].append(measure(engine, batch, args.prompt_tokens, args.new_tokens, rng))
    rows = []
    for batch in batches:
        measured = statistics.median(runs[batch])
        error = predicted[batch] / measured - 1
        rows.append(
            {
                "batch": batch,
                "predicted_step_s": predicted[batch],
                "measured_step_s": measured,
                "runs_s": runs[batch],
                "error": error,
                "within_target": abs(error) <= TARGET,
            }
        )
        log(
            f"batch {batch:>2}: predicted {predicted[batch] * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms "
            f"({error:+.0%})"
        )
    engine.shutdown()

    machine = machine_info()
    report = {
        "script": "plan_check",
        "command": command_line(),
        "model": args.model,
        "stack_overrides": args.overrides,
        "cpu": machine["cpu_model"],
        "machine": machine,
        "git": git_info(),
        "target": TARGET,
        "profile": {
            k: plan["profile"][k] for k in ("key", "measured_at", "processor", "threads", "prompt_tokens")
        },
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "results": rows,
        "all_within_target": all(r["within_target"] for r in rows),
    }
    path = write_result(result_dir("plan_check", args.out), "plan_check", report)
    plot(report, Path(path).with_suffix(".png"))
    print(
        json.dumps(
            {
                "cpu": report["cpu"],
                "all_within_target": report["all_within_target"],
                **{f"error_b{r['batch']}": round(r["error"], 3) for r in rows},
                "result": str(path),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
