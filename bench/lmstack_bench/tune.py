"""`lmstack tune STACK_OR_MODEL --slo ttft=2s,tpot=100ms`: find the stack with the most goodput
at a latency SLO on this machine.

Each candidate stack is checked as `lmstack check` checks one (resolved against the installed
plugins, the model's metadata read; no weights), then served by a short-lived `lmstack serve` on
a free loopback port and loaded by the `lmstack bench serve` machinery (the same workloads,
runner and goodput arithmetic) for `--duration` seconds. The search itself is
`lmstack_bench.tune_search`. The best stack is written as YAML under a comment block that says
what was measured, with a plot of every candidate beside it.

Any problem the user can fix is one line on stderr and exit status 2; a search in which no
candidate could be measured ends with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from lmstack_bench.cli import UsageError, _json_object, _positive_float, _positive_int, _slo
from lmstack_bench.metrics import SLO
from lmstack_bench.tune_search import CandidateFailed, Knob, Measurement, SearchResult, Trial, search
from lmstack_bench.workloads import WORKLOADS, LengthRange, WorkloadSpec

EXIT_ERROR = 2

# The rungs of the ordered scheduler knobs; a stack's own value joins its knob's ladder.
MAX_NUM_SEQS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_NUM_BATCHED_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
# 0 (no limit) is the loosest rung, so it sits last.
MAX_STEP_RATIO = (1.5, 2.5, 4.0, 0.0)
# Quantizers tried first on a CPU: what the project's measurements found fastest there.
QUANTIZER_ORDER = ("gguf", "int8", "rtn-int4", "none", "awq", "fp8", "nvfp4")
SPECULATORS = ("ngram",)  # speculation "on": the draft-free speculator, where installed
START_TIMEOUT_S = 240.0  # a server that is not healthy by then fails to start
STOP_GRACE_S = 10.0  # SIGTERM's drain, then SIGKILL


def main(argv: Sequence[str] | None = None, prog: str = "lmstack tune") -> int:
    from lmstack.errors import LmstackError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except (UsageError, LmstackError, ValueError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR


def build_parser(prog: str = "lmstack tune") -> argparse.ArgumentParser:
    from lmstack.commands.stack_args import add_stack_arguments

    p = argparse.ArgumentParser(
        prog=prog,
        description="Search the scheduler's knobs, the quantizer and KV dtype among those installed, "
        "and speculation on / off for the stack with the most goodput at a latency SLO: each "
        "candidate is served by a short-lived `lmstack serve` and measured with `lmstack bench "
        "serve`'s runner. Writes the best stack as YAML (a comment block says what was measured) "
        "and a plot of the candidates beside it.",
    )
    add_stack_arguments(p)
    p.add_argument("--slo", type=_slo, required=True, metavar="SPEC", help="e.g. ttft=2s,tpot=100ms")
    p.add_argument("--budget", type=_duration, default=1200.0, metavar="TIME",
                   help="wall-clock time for the whole search, servers included: 20m, 600s, 1h (default 20m)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("tuned.yaml"), metavar="FILE.yaml",
                   help="the best stack (default tuned.yaml); the plot goes beside it as .png")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the search's record as JSON")

    load = p.add_argument_group("load each candidate gets")
    load.add_argument("--concurrency", type=_positive_int, metavar="N",
                      help="closed loop: N clients (default 8)")  # fmt: skip
    load.add_argument("--request-rate", type=_positive_float, metavar="R", help="open loop: R requests/s")
    load.add_argument("--duration", type=_positive_float, default=20.0, metavar="S",
                      help="seconds of load per candidate (default 20)")  # fmt: skip
    load.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed requests first (default 2)")

    work = p.add_argument_group("workload (as `lmstack bench serve`)")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--input-len", type=_positive_int, default=200, metavar="TOKENS")
    work.add_argument("--output-len", type=_positive_int, default=64, metavar="TOKENS")
    work.add_argument("--num-prefixes", type=_positive_int, default=4, help="shared-prefix: system prompts")
    work.add_argument("--prefix-len", type=_positive_int, default=512, metavar="TOKENS", help="shared-prefix")
    work.add_argument("--turns", type=_positive_int, default=4, help="multi-turn: turns per conversation")
    work.add_argument(
        "--dataset-path", type=Path, metavar="FILE", help="sharegpt: a ShareGPT-format JSON file"
    )
    work.add_argument("--tokenizer", metavar="MODEL",
                      help="model whose tokenizer sizes the prompts (default: the stack's model)")  # fmt: skip
    work.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="for a stack whose server asks for one (default: $OPENAI_API_KEY)")  # fmt: skip
    work.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                      help="fields merged into every request body")  # fmt: skip
    work.add_argument("--seed", type=int, default=0)

    space = p.add_argument_group("search")
    space.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="KEY.PATH=V1,V2",
        help="search only these knobs, with these values (repeatable; values are YAML), e.g. "
        "--try scheduler.max_num_seqs=4,8 --try speculator={name: ngram}",
    )
    space.add_argument("--tie", type=float, default=0.03, metavar="F",
                       help="goodputs within this fraction of each other tie; a tie goes to more tok/s beyond the same "
                       "fraction, else to the stack already held (default 0.03)")  # fmt: skip
    space.add_argument("--no-rematch", dest="rematch", action="store_false",
                       help="skip measuring the winner and the start stack once more at the end")  # fmt: skip
    space.add_argument("--no-plot", dest="plot", action="store_false")
    space.add_argument("--no-progress", dest="progress", action="store_false")
    return p


# --- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from lmstack.commands.stack_args import stack_text
    from lmstack.stack.overrides import parse_overrides
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    if args.concurrency is not None and args.request_rate is not None:
        raise UsageError("give only one of --concurrency and --request-rate")
    if args.warmup < 0:
        raise UsageError("--warmup must be at least 0")
    if not 0.0 <= args.tie < 1.0:
        raise UsageError("--tie must be within [0, 1)")
    if args.out.suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"--out {args.out}: the tuned stack is a .yaml file")
    began = time.monotonic()
    start = start_mapping(stack_text(args), parse_overrides(args.overrides))
    pm = make_plugin_manager()
    registry = build_registry(pm)
    prepared = _prepare(start, pm)  # the start stack must pass `check`: a one-line error if not
    knobs = (
        knobs_from_tries(args.tries, start, prepared.resolved)
        if args.tries
        else default_knobs(
            prepared.resolved, registry, start, args.concurrency or (None if args.request_rate else 8)
        )
    )
    spec = WorkloadSpec(
        kind=args.workload,
        input_len=LengthRange(args.input_len),
        output_len=LengthRange(args.output_len),
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        turns=args.turns,
        dataset=args.dataset_path,
        seed=args.seed,
    )
    tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else prepared.source.tokenizer
    work_dir = Path(tempfile.mkdtemp(prefix="lmstack-tune-"))
    measure = ServerMeasure(
        spec=spec,
        tokenizer=tokenizer,
        slo=args.slo,
        concurrency=None if args.request_rate else (args.concurrency or 8),
        request_rate=args.request_rate,
        duration_s=args.duration,
        warmup=args.warmup,
        extra_body=args.extra_body,
        api_key=args.api_key,
        work_dir=work_dir,
        progress=args.progress,
    )
    # Time already spent (plugins, the model's metadata) counts against the budget; the rest is
    # the search's, less what writing the results takes.
    budget = args.budget - (time.monotonic() - began) - _WRITE_RESERVE_S
    bar = _Progress(budget, args.progress)
    try:
        result = search(
            start,
            knobs,
            measure,
            budget_s=budget,
            validate=lambda stack: _check(stack, pm),
            tie=args.tie,
            on_trial=bar.trial,
            rematch=args.rematch,
        )
    finally:
        bar.close()
    record = tune_record(args, result, knobs, work_dir)
    if result.best is None:
        if args.json:
            print(json.dumps(record, indent=1))
        print(f"error: no candidate could be measured ({result.stopped}); see {work_dir}", file=sys.stderr)
        return 1
    write_stack(args.out, result.best.stack, record)
    written = [args.out]
    if args.plot:
        png = args.out.with_suffix(".png")
        try:
            plot_trials(result, png, f"lmstack tune: {record['machine']['cpu_model']}, {record['date'][:10]}")
            written.append(png)
        except Exception as exc:  # the YAML is written; a plot must not lose it
            print(f"warning: could not draw {png}: {type(exc).__name__}: {exc}", file=sys.stderr)
    record["written"] = [str(p) for p in written]
    # The servers' stacks and logs stay only where a server failed: they say why.
    if not any(t.error and not t.error.startswith("rejected by check") for t in result.trials):
        shutil.rmtree(work_dir, ignore_errors=True)
        record["logs"] = None
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(summary_text(result))
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


_WRITE_RESERVE_S = 5.0  # the YAML and the plot (matplotlib's import) after the last candidate


def start_mapping(text: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The stack as given: a stack file's mapping, or `{model: TEXT}` for a model alone, with
    `--set` keys applied. Candidates are this mapping with keys set, so the tuned file keeps
    everything the user wrote (the comments aside)."""
    from lmstack.stack.config import stack_mapping
    from lmstack.stack.overrides import apply_overrides

    data = dict(stack_mapping(text))
    return apply_overrides(data, overrides) if overrides else data


def _prepare(stack: dict[str, Any], pm: Any) -> Any:
    from lmstack.stack.config import load_stack
    from lmstack.stack.prepare import prepare_stack

    return prepare_stack(load_stack(stack), plugin_manager=pm)


def _check(stack: dict[str, Any], pm: Any) -> str | None:
    """What `lmstack check` says against `stack` (one line), or None when it passes."""
    from lmstack.errors import LmstackError

    try:
        _prepare(stack, pm)
    except LmstackError as exc:
        return " ".join(str(exc).split())
    return None


def _tokenizer(name: str) -> Any:
    from lmstack.model.source import open_model_source

    return open_model_source(name).tokenizer


# --- the candidate space --------------------------------------------------------------------


def default_knobs(resolved: Any, registry: Any, start: dict[str, Any], concurrency: int | None) -> list[Knob]:
    """The knobs the search walks, most promising first: the running-sequence cap (batch size
    trades the gap between tokens against throughput), the weights' quantizer, speculation,
    the prefill step's bound, the step's token budget, then the KV-cache dtype."""
    described = resolved.describe()
    components = described["components"]
    knobs: list[Knob] = []
    sched = components["scheduler"]["options"]
    if "max_num_seqs" in sched:
        knobs.append(_ladder("scheduler.max_num_seqs", _seq_rungs(sched["max_num_seqs"], concurrency),
                             sched["max_num_seqs"]))  # fmt: skip

    quant = start.get("quant")
    current_q = (quant if isinstance(quant, str) else (quant or {}).get("weights")) or "auto"
    resolved_q = components["quantizer"]["name"]
    others = [n for n in registry.names("quantizer") if n not in (resolved_q, current_q)]
    others.sort(key=lambda n: (QUANTIZER_ORDER.index(n) if n in QUANTIZER_ORDER else len(QUANTIZER_ORDER), n))
    if others:
        knobs.append(Knob("quant.weights", (current_q, *others), current_q))

    spec_now = _section(start.get("speculator"), "none")
    spec_values = [spec_now]
    for name in ("none", *SPECULATORS):
        if name != spec_now["name"] and name in registry.names("speculator"):
            spec_values.append({"name": name})
    if len(spec_values) > 1:
        knobs.append(Knob("speculator", tuple(spec_values), spec_now))

    if "max_step_ratio" in sched:
        ratio = sched["max_step_ratio"]
        rungs = sorted({*MAX_STEP_RATIO, ratio}, key=lambda r: r if r > 0 else float("inf"))
        knobs.append(Knob("scheduler.max_step_ratio", tuple(rungs), ratio, ordered=True))
    if "max_num_batched_tokens" in sched:
        tokens = sched["max_num_batched_tokens"]
        knobs.append(_ladder("scheduler.max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS, tokens))

    kv_now = (quant or {}).get("kv_cache", "auto") if not isinstance(quant, str) else "auto"
    kv_resolved = described.get("kv_cache_dtype")
    kv_allowed = _kv_dtypes(components)
    # Each value once by the dtype it stores: `none` is the model's dtype, `auto` what resolved.
    stored = {"none": described.get("dtype"), "auto": kv_resolved}
    kv_values, seen = [kv_now], {stored.get(kv_now, kv_now)}
    for d in kv_allowed:
        if stored.get(d, d) not in seen:
            kv_values.append(d)
            seen.add(stored.get(d, d))
    if len(kv_values) > 1:
        knobs.append(Knob("quant.kv_cache", tuple(kv_values), kv_now))
    return knobs


def _seq_rungs(current: int, concurrency: int | None) -> tuple[int, ...]:
    """max_num_seqs rungs. Under a closed loop of N clients every value from N up admits them
    all alike, so the ladder has one such rung: the current value if it is N or more, else N."""
    if concurrency is None:
        return MAX_NUM_SEQS
    below = [v for v in MAX_NUM_SEQS if v < min(current, concurrency)]
    above = [v for v in MAX_NUM_SEQS if current < v < concurrency] + [concurrency] * (current < concurrency)
    return (*below, current, *above)


def _ladder(path: str, rungs: Sequence[int], current: int) -> Knob:
    return Knob(path, tuple(sorted({*rungs, current})), current, ordered=True)


def _section(value: Any, default: str) -> dict[str, Any]:
    if value is None:
        return {"name": default}
    if isinstance(value, str):
        return {"name": value}
    return {"name": default, **dict(value)}


def _kv_dtypes(components: dict[str, Any]) -> list[str]:
    """KV dtypes both attention kernels store: the stack's `quant.kv_cache` choices (`none` is
    the model's dtype) narrowed to what the kernels take."""
    from lmstack.stack.config import KV_CACHE_DTYPES

    allowed = ["none", *KV_CACHE_DTYPES]
    for phase in ("attention_prefill", "attention_decode"):
        caps = components.get(phase, {}).get("capabilities", {})
        if "kv_cache_dtypes" in caps:
            allowed = [d for d in allowed if d == "none" or d in caps["kv_cache_dtypes"]]
    return allowed


def knobs_from_tries(tries: list[str], start: dict[str, Any], resolved: Any) -> list[Knob]:
    """`--try KEY.PATH=V1,V2`: the named knobs only, each with the values given (YAML, split at
    top-level commas), the start stack's own value first."""
    knobs = []
    for item in tries:
        path, sep, text = item.partition("=")
        path = path.strip()
        if not sep or not path or not text.strip():
            raise UsageError(f"--try {item!r}: expected KEY.PATH=V1,V2")
        try:
            values = [yaml.safe_load(v) for v in _split_top(text)]
        except yaml.YAMLError:
            raise UsageError(f"--try {item!r}: a value is not YAML") from None
        current = _current_value(path, start, resolved)
        knobs.append(Knob(path, tuple([current] + [v for v in values if v != current]), current))
    return knobs


def _split_top(text: str) -> list[str]:
    """`4,8` -> ["4", "8"]; `{name: ngram, num_draft_tokens: 3},none` keeps the mapping whole."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "{[" and 1 or (-1 if ch in "}]" else 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in [*parts, cur] if p.strip()]


def _current_value(path: str, start: dict[str, Any], resolved: Any) -> Any:
    """The start stack's value at `path`: as written, else as resolved (a scheduler option's
    default), else None."""
    node: Any = start
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is not None:
        return node
    section, _, option = path.partition(".")
    component = resolved.describe()["components"].get(section)
    if component and option:
        return component["options"].get(option)
    if component:
        return {"name": component["name"]}
    return None


# --- measuring one candidate ----------------------------------------------------------------


@dataclasses.dataclass
class ServerMeasure:
    """measure(stack, deadline): serve `stack` on a free port, load it, stop it; by `deadline`."""

    spec: WorkloadSpec
    tokenizer: Any
    slo: SLO
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    warmup: int
    extra_body: dict[str, Any]
    work_dir: Path
    api_key: str | None = None
    progress: bool = True
    count: int = 0

    def __call__(self, stack: dict[str, Any], deadline: float) -> Measurement:
        from lmstack_bench.client import RequestOptions
        from lmstack_bench.metrics import summarize
        from lmstack_bench.runner import LoadSpec, Runner
        from lmstack_bench.workloads import sessions

        self.count += 1
        name = f"candidate-{self.count:02d}"
        with served(stack, self.work_dir / name, deadline, self.api_key) as (base_url, model):
            opts = RequestOptions(model=model, extra_body=self.extra_body)
            left = deadline - time.monotonic()
            runner = Runner(
                base_url, opts, api_key=self.api_key, timeout_s=max(left, 1.0), progress=self.progress
            )
            if self.warmup > 0:
                warm = sessions(
                    dataclasses.replace(self.spec, seed=self.spec.seed + 1_000_003), self.tokenizer
                )
                records = runner.run(warm, LoadSpec(concurrency=min(self.warmup, 8), num_requests=self.warmup),
                                     desc=f"{name} warm-up")  # fmt: skip
                if not any(r.ok for r in records):
                    raise CandidateFailed(f"every warm-up request failed: {records[0].error}")
            # Stop issuing in time for the requests in flight to end before the deadline.
            left = deadline - time.monotonic()
            duration = min(self.duration_s, left * 0.6)
            if duration < 1.0:
                raise CandidateFailed("no time left in the budget to load it")
            if self.concurrency is not None:
                load = LoadSpec(concurrency=self.concurrency, duration_s=duration, seed=self.spec.seed)
            else:
                load = LoadSpec(rate=self.request_rate, duration_s=duration, seed=self.spec.seed)
            records = runner.run(sessions(self.spec, self.tokenizer), load, desc=name)
        if not records or not any(r.ok for r in records):
            first = records[0].error if records else "no request was sent"
            raise CandidateFailed(f"every request failed: {first}")
        s = summarize(records, self.slo)
        details = {
            "completed": s.completed,
            "failed": s.failed,
            "duration_s": round(s.duration_s, 2),
            "slo_attainment": s.slo_attainment,
            "request_throughput": s.request_throughput,
            **{f"{k}_ms": None if v is None else {"p50": round(v.median, 1), "p99": round(v.p99, 1)}
               for k, v in (("ttft", s.ttft), ("tpot", s.tpot), ("itl", s.itl))},
        }  # fmt: skip
        return Measurement(goodput=s.goodput or 0.0, output_throughput=s.output_throughput, details=details)


# Run first in the server process (as lmstack_api.testing does): the kernel SIGTERMs the server
# when this process ends, so a killed tuner leaves no server loading the machine.
_END_WITH_PARENT = (
    "import sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes, os, signal\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))\n"
    "    if os.getppid() != {parent}: os._exit(1)\n"
    "from lmstack.cli import main\n"
    "sys.exit(main())\n"
)


@contextlib.contextmanager
def served(
    stack: dict[str, Any], folder: Path, deadline: float, api_key: str | None = None
) -> Iterator[tuple[str, str]]:
    """`lmstack serve` of `stack` on 127.0.0.1 and a free port, its stack and log in `folder`;
    yields (base URL, served model name) once /health answers. The server is stopped on the
    way out, and at `deadline` at the latest (its requests then fail, and the run ends)."""
    import httpx

    from lmstack.stack.overrides import apply_overrides

    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    stack_path = folder / "stack.yaml"
    stack_path.write_text(
        yaml.safe_dump(apply_overrides(stack, {"server.host": "127.0.0.1", "server.port": port}))
    )
    log_path = folder / "server.log"
    base = f"http://127.0.0.1:{port}"
    boot = _END_WITH_PARENT.format(parent=os.getpid())
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", boot, "serve", str(stack_path)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        # The budget's hard stop: the server goes at the deadline, whatever runs against it.
        timer = threading.Timer(max(deadline - time.monotonic(), 0.0), _kill_group, (proc,))
        timer.daemon = True
        timer.start()
        try:
            began = time.monotonic()
            give_up = min(deadline, began + START_TIMEOUT_S)
            while True:
                if proc.poll() is not None:
                    raise CandidateFailed(
                        f"the server exited with status {proc.returncode}: {_last_error(log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                        break
                if time.monotonic() > give_up:
                    waited = time.monotonic() - began
                    raise CandidateFailed(f"the server was not healthy after {waited:.0f} s; see {log_path}")
                time.sleep(0.3)
            try:
                headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
                model = httpx.get(base + "/v1/models", headers=headers, timeout=10.0).json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise CandidateFailed(f"/v1/models did not name the model: {exc}") from None
            yield base, model
        finally:
            timer.cancel()
            _stop(proc, min(STOP_GRACE_S, max(deadline - time.monotonic(), 1.0)))


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the server's process group (a drain: nothing is in flight by now), SIGKILL after
    `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc)
    proc.wait()


def _last_error(log_path: Path) -> str:
    """The server log's last line that says what went wrong (the one-line error of `serve`)."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line:
            return line[:300]
    return lines[-1][:300] if lines else f"no output; see {log_path}"


# --- the record, the tuned stack, the plot --------------------------------------------------


def tune_record(
    args: argparse.Namespace, result: SearchResult, knobs: list[Knob], work_dir: Path
) -> dict[str, Any]:
    from lmstack_bench.toolbox import cpu_kind, cpu_model

    return {
        "command": shlex.join(["lmstack", "tune", *args.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_model": cpu_model(), "cpu_kind": cpu_kind(), "cpu_count": os.cpu_count()},
        "slo": dataclasses.asdict(args.slo),
        "workload": {"kind": args.workload, "input_len": args.input_len, "output_len": args.output_len},
        "load": {
            "concurrency": None if args.request_rate else (args.concurrency or 8),
            "request_rate": args.request_rate,
            "duration_s": args.duration,
            "warmup": args.warmup,
        },  # fmt: skip
        "budget_s": args.budget,
        "knobs": [{"path": k.path, "values": list(k.values), "start": k.current} for k in knobs],
        "trials": [t.to_json() for t in result.trials],
        "best": None if result.best is None else result.best.index,
        "stopped": result.stopped,
        "logs": str(work_dir),
    }


def write_stack(path: Path, stack: dict[str, Any], record: dict[str, Any]) -> None:
    """The tuned stack as YAML under a comment block: the command, the machine, the date, the
    SLO and load, and every candidate's goodput and tok/s (or why it was not measured)."""
    slo = ", ".join(f"{k[:-3]} {v:g} ms" for k, v in record["slo"].items() if v is not None)
    load = record["load"]
    how = f"{load['concurrency']} clients" if load["concurrency"] else f"{load['request_rate']:g} req/s"
    m = record["machine"]
    lines = [
        "Tuned by `lmstack tune`: the candidate with the most goodput at the SLO (ties within",
        "the tie margin: more output tok/s). Measured on this machine; rerun it on another.",
        f"command: {record['command']}",
        f"date: {record['date']}",
        f"CPU: {m['cpu_model']} ({m['cpu_kind']}, {m['cpu_count']} cores)",
        f"SLO: {slo}; workload: {record['workload']['kind']}, {record['workload']['input_len']} prompt "
        f"tokens, {record['workload']['output_len']} output tokens; {how}, {load['duration_s']:g} s each",
        "candidates (goodput in requests/s meeting the SLO, output tok/s):",
    ]
    for t in record["trials"]:
        mark = "*" if t["index"] == record["best"] else " "
        if t["goodput"] is None:
            lines.append(f"{mark} {t['index']:2d} {t['label']}: {t['error']}")
        else:
            runs = f" (mean of {len(t['runs'])} runs)" if len(t["runs"]) > 1 else ""
            lines.append(f"{mark} {t['index']:2d} {t['label']}: goodput {t['goodput']:.3f}, "
                         f"{t['output_throughput']:.1f} tok/s{runs}")  # fmt: skip
    lines.append(f"stopped: {record['stopped']}")
    header = "".join("# " + ln.replace("\n", " ") + "\n" for ln in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(stack, sort_keys=False))


def summary_text(result: SearchResult) -> str:
    lines = [f"{len(result.trials)} candidates; {result.stopped}"]
    for t in result.trials:
        lines.append(("* " if t is result.best else "  ") + t.line())
    return "\n".join(lines)


def plot_trials(result: SearchResult, path: Path, title: str) -> None:
    """The candidates in the order tried, two panels: goodput at the SLO, and output tok/s;
    the best in green, those not measured in grey with their reason."""
    from lmstack_bench.toolbox import pyplot

    plt = pyplot()
    trials = result.trials
    fig, (ax_g, ax_t) = plt.subplots(1, 2, sharey=True, figsize=(10, 0.4 * len(trials) + 1.5))
    names = [f"{t.index}: {t.label}"[:60] for t in trials]
    colors = ["tab:green" if t is result.best else ("tab:blue" if t.ok else "lightgrey") for t in trials]
    for ax, key, label in (
        (ax_g, "goodput", "goodput (requests/s meeting the SLO)"),
        (ax_t, "output_throughput", "output tok/s"),
    ):
        values = [getattr(t.measurement, key) if t.measurement else 0.0 for t in trials]
        ax.barh(names, values, color=colors)
        top = max(values, default=0.0) or 1.0
        ax.set_xlim(0, top * 1.25)
        for i, (t, v) in enumerate(zip(trials, values)):
            text = f" {v:.3g}" if t.measurement else (" not measured" if ax is ax_t else f" {t.error}"[:48])
            ax.text(v, i, text, va="center", fontsize=7)
        ax.set_xlabel(label)
    ax_g.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Progress:
    """A bar over the budget's seconds; each candidate's line printed above it as it ends."""

    def __init__(self, budget_s: float, enabled: bool) -> None:
        from tqdm import tqdm

        self.began = time.monotonic()
        self.bar = tqdm(total=round(max(budget_s, 0)), desc="tune", unit="s", file=sys.stderr,
                        disable=not enabled, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s {postfix}")  # fmt: skip
        self.best: Trial | None = None
        self.enabled = enabled

    def trial(self, trial: Trial) -> None:
        from lmstack_bench.tune_search import beats

        line = f"[{trial.index}] {trial.line()} ({trial.seconds:.0f} s)"
        if self.enabled:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        if beats(trial, self.best):
            self.best = trial
        self.bar.n = min(round(time.monotonic() - self.began), self.bar.total)
        if self.best is not None and self.best.measurement is not None:
            self.bar.set_postfix_str(f"best goodput {self.best.measurement.goodput:.3f} req/s")
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _duration(text: str) -> float:
    """`20m`, `600s`, `1h`, `90` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 20m, 600s or 1h, got {text!r}")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    value = float(m.group(1)) * scale
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive, got {text!r}")
    return value


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
