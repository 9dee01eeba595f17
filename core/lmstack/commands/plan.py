"""`lmstack plan`: a capacity plan for a stack on this machine.

Memory (`plan_memory`): weights as resident, KV per token / sequence at `--context`, an
activation estimate and the runtime, against the device's memory, and the sequences that fit.
With `--profile`, a short measured profile (`plan_profile`: prefill tokens/s, decode step time
by batch size) is recorded and cached; with a cached profile the predicted step times are
printed, and with `--rate` / `--slo` the replicas a request rate needs (`plan_queue`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmstack.commands.stack_args import add_stack_arguments, positive_int
from lmstack.errors import LmstackError

PREDICT_BATCHES = (1, 2, 4, 8, 16, 32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stack_arguments(parser)
    parser.add_argument(
        "--context",
        type=positive_int,
        metavar="N",
        help="tokens a sequence holds (prompt + output) for the KV figures (default: the stack's max_model_len)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="measure this machine for the stack now (prefill tokens/s; decode step time at batch 1-32 "
        "through the real engine with dummy prompts) and cache it under ~/.cache/lmstack/plan/",
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        metavar="R",
        help="requests a second to plan replicas for (needs a profile)",
    )
    parser.add_argument(
        "--workload",
        metavar="prompt=N,output=N",
        help="mean prompt and output tokens of a request for --rate (default prompt=512,output=128)",
    )
    parser.add_argument(
        "--slo",
        metavar="ttft=2s,tpot=100ms",
        help="latency targets: time to first token, time per output token",
    )
    parser.add_argument(
        "--measure-weights",
        action="store_true",
        help="load the weights in this process to measure their resident bytes (the default under a "
        "quantizer; unquantized weights are counted on the meta device, none read)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _progress(msg: str) -> None:
    print(f"profiling: {msg}", file=sys.stderr, flush=True)


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything `lmstack plan` prints, as a JSON-able dict."""
    from lmstack.commands.plan_memory import plan_memory
    from lmstack.commands.plan_profile import StepModel, load_profile, profile_key
    from lmstack.commands.plan_queue import parse_slo, parse_workload, plan_replicas
    from lmstack.commands.stack_args import stack_from_args
    from lmstack.stack.build import check_build
    from lmstack.stack.prepare import prepare_stack

    # Options are checked before anything heavy runs.
    slo, workload = parse_slo(args.slo), parse_workload(args.workload)
    prepared = prepare_stack(stack_from_args(args))
    r, mc = prepared.resolved, prepared.model_config
    built = check_build(r, mc, prepared.models)
    # Unquantized weights are counted exactly on the meta device; a quantizer's resident
    # layout (re-packed, re-laid copies) is only known once it has processed the loaded weights.
    measured = None
    if args.measure_weights or r.quantizer.name != "none":
        measured = _measure_weights(prepared, built["quantizer"])
    memory = plan_memory(prepared, built, args.context, measured)

    key = profile_key(prepared)
    profile = _record_profile(prepared, key) if args.profile else load_profile(key)
    out: dict[str, Any] = {
        "stack": args.stack,
        "model": r.model,
        "model_config": {
            "layers": mc.num_layers,
            "hidden": mc.hidden_size,
            "heads": mc.num_heads,
            "kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "context": mc.max_position_embeddings,
        },
        "memory": memory.to_json(),
        "profile": None,
        "replicas": None,
    }
    if profile is None:
        if args.rate is not None or args.slo:
            raise LmstackError(
                "--rate and --slo need a measured profile of this stack on this machine: add --profile "
                "(it runs the engine for about a minute and is cached)"
            )
        return out
    from lmstack.commands.plan_profile import cache_dir

    model = StepModel.fit(profile)
    a, b = model.linear()
    out["profile"] = {
        **profile.to_json(),
        "path": str(cache_dir() / f"{key}.json"),
        "fit": "piecewise linear through the measured points",
        "linear_summary_s": {"a": a, "b": b},
        "predicted": [
            {"batch": n, "step_s": model.step_s(n), "tpot_s": model.tpot_s(n)}
            for n in sorted({*PREDICT_BATCHES, *(d.batch for d in profile.decode)})
            if n <= memory.max_num_seqs
        ],
    }
    if args.rate is not None or args.slo:
        per_seq = -(-(workload.prompt_tokens + workload.output_tokens) // memory.block_size)
        max_batch = min(memory.max_num_seqs, memory.num_blocks // per_seq)
        out["replicas"] = plan_replicas(
            args.rate or 0.0, workload, slo, model, profile.prefill_tok_s, max_batch
        ).to_json()
    return out


def _measure_weights(prepared: Any, quantizer: Any) -> Any:
    from lmstack.model.bounds import table_positions
    from lmstack.model.memory import measure_weights

    r, mc = prepared.resolved, prepared.model_config
    positions = table_positions(mc.max_position_embeddings, r.config.max_model_len)
    return measure_weights(prepared.source, mc, quantizer, dtype=r.dtype, max_positions=positions)


def _record_profile(prepared: Any, key: str) -> Any:
    """Build the engine for the stack, measure it, cache the profile."""
    from lmstack.commands.plan_profile import profile_batches, run_profile, save_profile
    from lmstack.engine.llm_engine import LLMEngine

    _progress("building the engine (weights loaded, KV cache allocated)")
    engine = LLMEngine(prepared)
    try:
        per_seq = -(-128 // engine.allocator.block_size)  # the decode runs' context, rounded up
        max_batch = min(engine.limits.max_num_seqs, engine.allocator.num_blocks // per_seq)
        if max_batch < 1:
            raise LmstackError(
                f"the KV cache ({engine.allocator.num_blocks} blocks of {engine.allocator.block_size} tokens) "
                "holds no 128-token sequence to profile decoding with: give it more memory"
            )
        profile = run_profile(engine, key, profile_batches(max_batch), progress=_progress)
    finally:
        engine.shutdown()
    _progress(f"cached in {save_profile(profile)}")
    return profile


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(render(plan))
    return 0


# --- the human output ---------------------------------------------------------------------------


def _size(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in [header, *rows]
    ]


def render(plan: dict[str, Any]) -> str:
    m, c = plan["memory"], plan["model_config"]
    lines = [
        f"stack     {plan['stack']}",
        f"model     {plan['model']}",
        f"          {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads ({c['kv_heads']} KV), "
        f"head_dim {c['head_dim']}, context {c['context']}",
        f"device    {m['device']}: {_size(m['device_available_bytes'])} available of {_size(m['device_total_bytes'])}",
        "",
    ]
    rows = [
        ["weights (resident)", _size(m["weights_bytes"]), m["weights_how"]],
        ["KV cache", _size(m["kv_cache_bytes"]), f"{m['num_blocks']} blocks; {m['kv_budget_how']}"],
        ["activations / scratch", _size(m["activation_bytes"]), m["activation_how"]],
        ["runtime", _size(m["runtime_bytes"]), m["runtime_how"]],
        ["total planned", _size(m["planned_bytes"]), ""],
    ]
    lines += _table(["MEMORY", "SIZE", "HOW"], rows)
    headroom = m["headroom_bytes"]
    if headroom is not None:
        where = "the device's memory" if m["device"].startswith("cuda") else "what is available now"
        lines.append(f"{'headroom':<22} {_size(headroom)} of {where}")
        if headroom < 0:
            lines.append(f"warning: the plan needs {_size(-headroom)} more than {where}")
    lines += [
        "",
        f"KV        {m['kv_bytes_per_token']} B a token ({m['kv_dtype']}), {_size(m['kv_bytes_per_block'])} a "
        f"block of {m['block_size']} tokens",
        f"          at context {m['context']}: {m['blocks_per_sequence']} blocks, "
        f"{_size(m['kv_bytes_per_sequence'])} a sequence (max_model_len {m['max_model_len']})",
        f"fits      {m['sequences_fit']} sequences of {m['context']} tokens in the KV cache; "
        f"max_num_seqs {m['max_num_seqs']}: {m['concurrent']} at once",
    ]
    p = plan["profile"]
    if p is None:
        lines.append("profile   none for this stack on this machine: --profile measures one (cached)")
    else:
        lines += [
            "",
            f"profile   {p['path']}",
            f"          measured {p['measured_at']} on {p['processor']}, {p['threads']} threads, torch {p['torch']}",
            f"prefill   {p['prefill_tok_s']:.0f} tokens/s ({p['prefill_tokens']}-token prompt)",
            f"decode    step time t(B): {p['fit']}; as a line {p['linear_summary_s']['a'] * 1e3:.2f} ms + "
            f"{p['linear_summary_s']['b'] * 1e3:.3f} ms x B (context ~{p['prompt_tokens']} tokens)",
        ]
        measured = {d["batch"]: d["step_s"] for d in p["decode"]}
        rows = [
            [
                str(q["batch"]),
                f"{measured[q['batch']] * 1e3:.2f}" if q["batch"] in measured else "-",
                f"{q['step_s'] * 1e3:.2f}",
                f"{q['tpot_s'] * 1e3:.2f}",
                f"{q['batch'] / q['tpot_s']:.0f}",
            ]
            for q in p["predicted"]
        ]
        lines += [
            "          " + row
            for row in _table(["BATCH", "MEASURED ms", "PREDICTED ms", "TPOT ms", "TOK/S"], rows)
        ]
    rep = plan["replicas"]
    if rep is not None:
        lines += ["", *_render_replicas(rep)]
    return "\n".join(lines)


def _render_replicas(rep: dict[str, Any]) -> list[str]:
    w, slo = rep["workload"], rep["slo"]
    targets = ", ".join(
        f"{k} {v * 1e3:.0f} ms"
        for k, v in (("ttft", slo["ttft_s"]), ("tpot", slo["tpot_s"]))
        if v is not None
    )
    rate = f"{rep['rate']:g} requests/s" if rep["rate"] else "no --rate (one replica's capacity)"
    lines = [
        f"load      {rate} of {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens"
        + (f"; SLO {targets}" if targets else "")
    ]
    if not rep["feasible"]:
        lines.append(f"replicas  none meets it: {rep['reason']}")
    else:
        lines += [
            f"replicas  {rep['replicas']} (utilisation {rep['utilisation']:.0%})",
            f"          batch {rep['batch']}: step {rep['step_s'] * 1e3:.1f} ms, {rep['tpot_s'] * 1e3:.1f} ms a token; "
            f"a replica serves {rep['replica_capacity_rps']:.2f} requests/s",
            f"          TTFT ~{rep['ttft_s']:.2f} s (prefill {rep['prefill_s']:.2f} s + queue {rep['queue_wait_s']:.2f} s); "
            f"request ~{rep['request_latency_s']:.1f} s",
        ]
    lines.append("assumes   " + rep["assumptions"][0])
    lines += [f"          {a}" for a in rep["assumptions"][1:]]
    return lines
