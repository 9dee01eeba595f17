"""`lmstack plan --rate`: the replicas a request rate needs, from the measured step-time model
and a stated queueing model (`ASSUMPTIONS`, printed with every answer)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from lmstack.commands.plan_profile import StepModel
from lmstack.errors import LmstackError

DEFAULT_PROMPT_TOKENS = 512
DEFAULT_OUTPUT_TOKENS = 128
MAX_UTILISATION = 0.8
MAX_REPLICAS = 100_000

ASSUMPTIONS = (
    "requests arrive as a Poisson stream at --rate and are spread evenly over the replicas",
    "every request has the workload's mean prompt and output tokens",
    "each replica decodes at batch B, the largest batch (up to max_num_seqs, the sequences that "
    "fit at prompt+output tokens and the largest profiled batch) whose time per output token, "
    "t(B) interpolated between the profiled batches, meets the tpot SLO",
    "a request costs its replica prompt/prefill_tok_s seconds of prefill (the profiled rate; the batch waits) plus "
    "output/tokens_per_step steps shared by B sequences: capacity mu = 1/(prefill + output*t(B)/B)",
    f"replicas: the fewest n with utilisation rate/(n*mu) <= {MAX_UTILISATION} whose TTFT meets the "
    "ttft SLO, TTFT = queueing wait (M/M/n, Erlang C, service rate mu) + the request's prefill",
    "decode step times are those measured at short context; a long context adds attention time",
)


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    output_tokens: int = DEFAULT_OUTPUT_TOKENS


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None


_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _seconds(text: str, key: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", text)
    if not m:
        raise LmstackError(f"--slo {key}: expected a duration like 2s or 100ms, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if value <= 0:
        raise LmstackError(f"--slo {key}: must be positive, got {text!r}")
    return value


def _pairs(text: str, option: str, keys: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise LmstackError(f"{option}: expected {','.join(k + '=...' for k in keys)}, got {part!r}")
        out[key] = value.strip()
    return out


def parse_slo(text: str | None) -> Slo:
    if not text:
        return Slo()
    pairs = _pairs(text, "--slo", ("ttft", "tpot"))
    return Slo(*(_seconds(pairs[k], k) if k in pairs else None for k in ("ttft", "tpot")))


def parse_workload(text: str | None) -> Workload:
    if not text:
        return Workload()
    pairs = _pairs(text, "--workload", ("prompt", "output"))
    values = {}
    for key, value in pairs.items():
        if not value.isdigit() or int(value) < 1:
            raise LmstackError(f"--workload {key}: expected a positive token count, got {value!r}")
        values[f"{key}_tokens"] = int(value)
    return Workload(**values)


def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/`servers` with `offered` = rate/mu (< servers), from
    the Erlang B recursion (no factorials: stays finite for many servers)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


@dataclass
class ReplicaPlan:
    feasible: bool
    reason: str
    rate: float
    workload: Workload
    slo: Slo
    batch: int = 0
    step_s: float = 0.0
    tpot_s: float = 0.0
    prefill_s: float = 0.0
    replica_capacity_rps: float = 0.0
    replicas: int = 0
    utilisation: float = 0.0
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0
    request_latency_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "assumptions": list(ASSUMPTIONS)}


def plan_replicas(
    rate: float, workload: Workload, slo: Slo, model: StepModel, prefill_tok_s: float, max_batch: int
) -> ReplicaPlan:
    """The replicas `rate` requests/s of `workload` need under `slo` (see `ASSUMPTIONS`)."""
    plan = ReplicaPlan(False, "", rate, workload, slo)
    max_batch = min(max_batch, model.points[-1][0])  # no extrapolation past what was measured
    if max_batch < 1:
        plan.reason = (
            f"no sequence of {workload.prompt_tokens + workload.output_tokens} tokens fits the KV cache"
        )
        return plan
    batch = max_batch
    if slo.tpot_s is not None:
        meets = [b for b in range(1, max_batch + 1) if model.tpot_s(b) <= slo.tpot_s]
        if not meets:
            plan.reason = (
                f"tpot SLO {slo.tpot_s * 1e3:.0f} ms is not met even at batch 1 "
                f"({model.tpot_s(1) * 1e3:.1f} ms a token): more replicas do not help"
            )
            return plan
        batch = max(meets)
    plan.batch, plan.step_s, plan.tpot_s = batch, model.step_s(batch), model.tpot_s(batch)
    plan.prefill_s = workload.prompt_tokens / prefill_tok_s
    decode_share = workload.output_tokens * plan.tpot_s / batch
    mu = 1.0 / (plan.prefill_s + decode_share)
    plan.replica_capacity_rps = mu
    plan.request_latency_s = plan.prefill_s + workload.output_tokens * plan.tpot_s
    if slo.ttft_s is not None and plan.prefill_s > slo.ttft_s:
        plan.reason = (
            f"ttft SLO {slo.ttft_s:g} s is below a {workload.prompt_tokens}-token prompt's prefill alone "
            f"({plan.prefill_s:.2f} s)"
        )
        return plan
    n = max(1, math.ceil(rate / (MAX_UTILISATION * mu)))
    while n <= MAX_REPLICAS:
        offered = rate / mu
        wait = erlang_c(n, offered) / (n * mu - rate) if rate > 0 else 0.0
        if slo.ttft_s is None or wait + plan.prefill_s <= slo.ttft_s:
            plan.feasible, plan.replicas = True, n
            plan.utilisation, plan.queue_wait_s = rate / (n * mu), wait
            plan.ttft_s = wait + plan.prefill_s
            plan.reason = "ok"
            return plan
        n += 1
    plan.reason = f"more than {MAX_REPLICAS} replicas"
    return plan
