"""Decode of lmstack alone: tokens/s over repeated runs, a cProfile of one run, or a
torch.profiler breakdown of the decode steps by region.

Meant for A/B checks of engine changes: run it with two checkouts' interpreters, alternating,
on a quiet machine, and compare medians (and, with --profile, the function calls per token: a
change that adds per-step Python work shows up there even when the timings are noisy).

    python benchmarks/e2e/decode_profile.py --dtype bfloat16 --repeats 5
    python benchmarks/e2e/decode_profile.py --profile --top 25
    python benchmarks/e2e/decode_profile.py --dtype float32 --batch 32 --ops --top 20
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

from lmstack_bench.toolbox import offline_stack

# (label, module, attribute): the regions --ops times, wrapped in torch.profiler record_function
# for the run only, so the core carries no profiling hooks.
_REGIONS = (
    ("step", "lmstack.engine.llm_engine", "LLMEngine.step"),
    ("model_runner.execute", "lmstack.exec.model_runner", "ModelRunner.execute"),
    ("model.forward", "lmstack.model.llama", "LlamaModel.forward"),
    ("attention.attend", "lmstack.exec.model_runner", "ForwardContext.attend"),
    ("sampler", "lmstack.sample.step_sampler", "StepSampler.choose"),
)


def decode_once(engine, prompt: list[int], new_tokens: int, batch: int = 1) -> float:
    """Tokens/s after the first token (summed over `batch` greedy requests of `prompt`, all
    prefilled in the first step), each run to `new_tokens`."""
    from lmstack.sampling_params import SamplingParams

    for _ in range(batch):
        engine.add_request(
            list(prompt), SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        )
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    # stamps[0] is the prefill step (first tokens); the rest are one token per request each.
    return batch * (len(stamps) - 1) / (stamps[-1] - stamps[0])


@contextlib.contextmanager
def _regions():
    """record_function around each of _REGIONS for the duration."""
    import importlib

    import torch

    saved = []
    for label, module, attr in _REGIONS:
        owner_name, name = attr.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        fn = owner.__dict__[name]

        def wrapped(*a, _fn=fn, _label=label, **kw):
            with torch.profiler.record_function(_label):
                return _fn(*a, **kw)

        setattr(owner, name, functools.wraps(fn)(wrapped))
        saved.append((owner, name, fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def op_profile(engine, prompt: list[int], args) -> dict:
    """torch.profiler over the decode steps of one run: aten ops per step and where the time
    goes (regions are inclusive; `ops` excludes the regions' own rows)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lmstack.sampling_params import SamplingParams

    for _ in range(args.batch):
        engine.add_request(
            list(prompt), SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        )
    engine.step()  # the prefill step, outside the profile
    steps = 0
    with _regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    events = prof.key_averages()
    labels = {label for label, _, _ in _REGIONS}
    regions = {e.key: e.cpu_time_total / steps / 1e3 for e in events if e.key in labels}
    ops = [e for e in events if e.key not in labels]
    total_ops = sum(e.count for e in ops) / steps
    # Ops entered from Python (not called by another op): what per-op dispatch overhead scales with.
    outer = sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    mm_self = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    result = {
        "batch": args.batch,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "decode_steps": steps,
        "aten_ops_per_step": round(total_ops, 1),
        "outer_aten_ops_per_step": round(outer / steps, 1),
        "matmul_self_ms_per_step": round(mm_self / steps / 1e3, 3),
        "region_ms_per_step": {k: round(v, 3) for k, v in sorted(regions.items())},
        "top_ops_self_us_per_step": {
            e.key: [round(e.self_cpu_time_total / steps, 1), round(e.count / steps, 1)] for e in top
        },
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=1, help="concurrent greedy requests")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--profile", action="store_true", help="cProfile one run instead of timing")
    p.add_argument("--ops", action="store_true", help="torch.profiler breakdown of one run's decode steps")
    p.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    p.add_argument("--json", type=Path, help="append the result (timings or --ops) to this JSON file")
    p.add_argument("--label", default="", help="a name for this run in --json")
    args = p.parse_args(argv)
    if args.new_tokens < 3 or args.prompt_len < 1 or args.repeats < 1 or args.batch < 1:
        p.error("--new-tokens must be >= 3, --prompt-len, --repeats and --batch >= 1")

    from lmstack.engine.llm_engine import LLMEngine

    engine = LLMEngine(offline_stack(args.model, args.dtype, max_num_seqs=max(16, args.batch)))
    prompt = list(range(100, 100 + args.prompt_len))
    record: dict = {}
    try:
        decode_once(engine, prompt, args.new_tokens, args.batch)  # warm-up
        if args.ops:
            record = op_profile(engine, prompt, args)
            for key, value in record.items():
                if key != "top_ops_self_us_per_step":
                    print(f"{key}: {value}")
            print("op: self us per step, calls per step")
            for op, (us, calls) in record["top_ops_self_us_per_step"].items():
                print(f"  {op:40s} {us:9.1f} {calls:7.1f}")
        elif args.profile:
            prof = cProfile.Profile()
            prof.enable()
            decode_once(engine, prompt, args.new_tokens, args.batch)
            prof.disable()
            stats = pstats.Stats(prof, stream=sys.stdout)
            print(f"{stats.total_calls} function calls for {args.new_tokens} steps "
                  f"({stats.total_calls / args.new_tokens:.0f} per step)")  # fmt: skip
            stats.sort_stats("tottime").print_stats(args.top)
        else:
            runs = [decode_once(engine, prompt, args.new_tokens, args.batch) for _ in range(args.repeats)]
            record = {"batch": args.batch, "dtype": args.dtype, "median_tok_s": statistics.median(runs),
                      "runs": [round(r, 2) for r in runs]}  # fmt: skip
            print(f"{args.dtype} batch-{args.batch} decode: median {statistics.median(runs):.2f} tok/s "
                  f"over {args.repeats} runs {[round(r, 1) for r in runs]}")  # fmt: skip
    finally:
        engine.shutdown()
    if args.json and record:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        from lmstack.kernels.hardware import cpu_description

        entry = {"label": args.label, **cpu_description(), **record}
        args.json.write_text(json.dumps([*old, entry], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
