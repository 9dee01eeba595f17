"""`lmstack bench serve` (benchmark a live server) and `lmstack bench plot` (combine results).

Any problem the user can fix is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from lmstack_bench.client import ENDPOINTS, RequestOptions
from lmstack_bench.metrics import SLO, parse_slo
from lmstack_bench.report import BenchResult, RunResult, load_result, plot_cdfs, plot_sweep, table
from lmstack_bench.runner import ARRIVALS, LoadSpec, Runner
from lmstack_bench.workloads import WORKLOADS, LengthRange, WorkloadSpec, sessions

EXIT_ERROR = 2


class UsageError(Exception):
    """A problem with the command line or the server that the user can fix."""


def main(argv: Sequence[str] | None = None, prog: str = "lmstack bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (UsageError, ValueError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR


def build_parser(prog: str = "lmstack bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmark OpenAI-compatible servers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="load a live server and report latency percentiles, throughput and goodput",
        description="Send a workload to a running OpenAI-compatible server (lmstack, vLLM, llama.cpp's "
        "llama-server, ...) and measure TTFT, TPOT, inter-token latency, end-to-end latency, "
        "throughput and goodput. Writes JSON and plots.",
    )
    target = s.add_argument_group("server")
    target.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    target.add_argument(
        "--tokenizer",
        help="model whose tokenizer sizes the prompts: a known name, a .gguf file, a Hugging Face "
        "folder or Hub id (org/name, org/name:Q4_K_M, from the Hugging Face cache or downloaded; "
        "default: --model)",
    )
    target.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY"
    )
    target.add_argument("--label", help="name of this server in tables and plots (default: the base URL)")
    target.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout")

    load = s.add_argument_group("load (one of --concurrency, --request-rate, --sweep)")
    load.add_argument("--concurrency", type=_positive_int, metavar="N", help="closed loop: N clients")
    load.add_argument("--request-rate", type=_positive_float, metavar="R", help="open loop: R sessions/s")
    load.add_argument("--arrivals", choices=ARRIVALS, default="poisson", help="open-loop arrival process")
    load.add_argument("--max-concurrency", type=_positive_int, metavar="N", help="open loop: cap in flight")
    load.add_argument(
        "--sweep",
        metavar="KIND=V1,V2,...",
        help="run once per value: concurrency=1,2,4,8 (closed loop) or rate=0.5,1,2 (open loop)",
    )
    load.add_argument("--num-requests", type=_positive_int, metavar="N", help="requests per load point")
    load.add_argument("--duration", type=_positive_float, metavar="S", help="seconds per load point")
    load.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed requests first (default 2)")

    work = s.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--input-len", type=_positive_int, default=200, metavar="TOKENS")
    work.add_argument("--input-len-spread", type=float, default=0.0, metavar="F",
                      help="input lengths uniform in input-len * [1-F, 1+F]")  # fmt: skip
    work.add_argument("--output-len", type=_positive_int, default=128, metavar="TOKENS")
    work.add_argument("--output-len-spread", type=float, default=0.0, metavar="F")
    work.add_argument("--num-prefixes", type=_positive_int, default=4, help="shared-prefix: system prompts")
    work.add_argument("--prefix-len", type=_positive_int, default=512, metavar="TOKENS", help="shared-prefix")
    work.add_argument("--turns", type=_positive_int, default=4, help="multi-turn: turns per conversation")
    work.add_argument(
        "--dataset-path", type=Path, metavar="FILE", help="sharegpt: a ShareGPT-format JSON file"
    )
    work.add_argument(
        "--no-fixed-output",
        dest="fixed_output",
        action="store_false",
        help="let requests stop at EOS (default: exactly the output length: min_tokens = max_tokens, "
        "ignore_eos)",
    )
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                      help="fields merged into every request body")  # fmt: skip
    work.add_argument("--seed", type=int, default=0)

    out = s.add_argument_group("report")
    out.add_argument("--slo", type=_slo, metavar="SPEC", help="goodput objectives, e.g. ttft=500ms,tpot=50ms")
    out.add_argument(
        "--out",
        type=Path,
        metavar="FILE.json",
        help="where to write the JSON; the plots go beside it (default: bench-serve-<time>.json)",
    )
    out.add_argument("--no-plot", dest="plot", action="store_false")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(handler=cmd_serve)

    p = sub.add_parser("plot", help="one table and one set of plots from several result files")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    p.add_argument(
        "--out", type=Path, required=True, metavar="PREFIX", help="writes PREFIX-cdf.png (and -sweep.png)"
    )
    p.set_defaults(handler=cmd_plot)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    loads = _loads(args)
    base_url = args.base_url.rstrip("/")
    model = args.model or _first_model(base_url, args.api_key)
    tokenizer = _tokenizer(args.tokenizer or model)
    spec = WorkloadSpec(
        kind=args.workload,
        input_len=LengthRange(args.input_len, args.input_len_spread),
        output_len=LengthRange(args.output_len, args.output_len_spread),
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        turns=args.turns,
        dataset=args.dataset_path,
        seed=args.seed,
    )
    opts = RequestOptions(
        model=model,
        endpoint=args.endpoint,
        temperature=args.temperature,
        fixed_output=args.fixed_output,
        extra_body=args.extra_body,
    )
    runner = Runner(base_url, opts, api_key=args.api_key, timeout_s=args.timeout, progress=args.progress)
    slo: SLO | None = args.slo
    result = BenchResult(
        label=args.label or base_url,
        base_url=base_url,
        model=model,
        config={
            "command": "lmstack bench " + shlex.join(args.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "workload": _jsonable(dataclasses.asdict(spec)),
            "request": dataclasses.asdict(opts),
            "warmup": args.warmup,
            "slo": dataclasses.asdict(slo) if slo else None,
            "tokenizer": args.tokenizer or model,
        },
    )

    if args.warmup > 0:
        # Different seed: the timed prompts must not be the warm-up's (a prefix cache would hit).
        warm = sessions(dataclasses.replace(spec, seed=spec.seed + 1_000_003), tokenizer)
        warm_load = LoadSpec(concurrency=min(args.warmup, 8), num_requests=args.warmup)
        records = runner.run(warm, warm_load, desc="warm-up")
        if not any(r.ok for r in records):
            raise UsageError(f"every warm-up request failed; the first: {records[0].error}")

    for load in loads:
        records = runner.run(sessions(spec, tokenizer), load)
        result.runs.append(RunResult.of(load, records, slo))
        s = result.runs[-1].summary
        print(
            f"{load.label}: {s.completed} ok, {s.failed} failed, {s.output_throughput:.1f} output tok/s",
            file=sys.stderr,
        )

    out = args.out or Path(f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    result.write_json(out)
    print(table([result]))
    written = [out]
    if args.plot:
        written.append(out.with_name(out.stem + "-cdf.png"))
        plot_cdfs([result], written[-1])
        if len(result.runs) > 1:
            written.append(out.with_name(out.stem + "-sweep.png"))
            plot_sweep([result], written[-1])
    print("wrote " + ", ".join(str(p) for p in written))
    failed = sum(r.summary.failed for r in result.runs)
    if failed:
        print(f"warning: {failed} requests failed (see 'errors' in {out})", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    results = []
    for path in args.results:
        try:
            results.append(load_result(path))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise UsageError(f"{path} is not a `lmstack bench serve` result ({exc})") from None
    print(table(results))
    cdf = args.out.with_name(args.out.name + "-cdf.png")
    plot_cdfs(results, cdf)
    written = [cdf]
    if any(len(r.runs) > 1 for r in results):
        written.append(args.out.with_name(args.out.name + "-sweep.png"))
        plot_sweep(results, written[-1])
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _loads(args: argparse.Namespace) -> list[LoadSpec]:
    given = [x for x in (args.concurrency, args.request_rate, args.sweep) if x is not None]
    if len(given) > 1:
        raise UsageError("give only one of --concurrency, --request-rate and --sweep")
    num, duration = args.num_requests, args.duration
    if num is None and duration is None:
        num = 64
    common = {"num_requests": num, "duration_s": duration, "seed": args.seed}
    open_loop = {"arrivals": args.arrivals, "max_concurrency": args.max_concurrency}
    if args.sweep is None:
        if args.request_rate is not None:
            return [LoadSpec(rate=args.request_rate, **open_loop, **common)]
        return [LoadSpec(concurrency=args.concurrency or 1, **common)]
    kind, sep, values = args.sweep.partition("=")
    kind = kind.strip().lower()
    if not sep or kind not in ("concurrency", "rate"):
        raise UsageError(f"bad --sweep {args.sweep!r}: expected concurrency=1,2,4 or rate=0.5,1,2")
    try:
        points = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"bad --sweep values {values!r}: expected numbers separated by commas") from None
    if not points:
        raise UsageError("--sweep lists no values")
    if kind == "concurrency":
        if any(p != int(p) for p in points):
            raise UsageError("--sweep concurrency values must be whole numbers")
        return [LoadSpec(concurrency=int(p), **common) for p in points]
    return [LoadSpec(rate=p, **open_loop, **common) for p in points]


def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach {base_url}: {exc}") from None
    if resp.status_code != 200:
        raise UsageError(f"{base_url}/v1/models answered HTTP {resp.status_code}; give --model")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise UsageError(f"{base_url}/v1/models lists no model; give --model") from None


def _tokenizer(name_or_path: str) -> Any:
    from lmstack.errors import LmstackError
    from lmstack.model.source import open_model_source

    try:
        return open_model_source(name_or_path).tokenizer
    except LmstackError as exc:
        raise UsageError(f"cannot load a tokenizer from {name_or_path!r} ({exc}); give --tokenizer") from None


def _jsonable(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj, default=str))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _slo(text: str) -> SLO:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
