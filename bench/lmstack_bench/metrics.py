"""What one benchmark run measured, and the arithmetic that turns requests into a report.

Definitions (the same for every server, so peers are compared on one scale):

- **TTFT**: from sending the request to the first chunk that carries generated text.
- **ITL** (inter-token latency): the gaps between consecutive text-carrying chunks of one request,
  pooled over all requests. A chunk that carries several tokens (speculative decoding) is one gap.
- **TPOT** (time per output token), per request: ``(e2e - ttft) / (output_tokens - 1)``; undefined
  for a request with fewer than two output tokens (left out of the TPOT statistics, and it meets a
  TPOT SLO by definition).
- **E2E**: from sending the request to the end of its response.
- **Percentiles** interpolate linearly between the closest ranks (NumPy's default method).
- **Goodput**: successful requests per second that met every SLO given.
- Throughputs divide by the run's duration: from the first request sent to the last one finished.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on the client's monotonic clock."""

    start: float
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None
    # Arrival time of every chunk that carried text, in order; the first equals `first_token`.
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None
    turn: int = 0  # which turn of its session (multi-turn: 1 and later carry a history)
    # Prompt tokens the server served from its prefix cache (usage.prompt_tokens_details), if said.
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in milliseconds."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        ms = [v * 1000.0 for v in values]
        return cls(
            count=len(ms),
            mean=sum(ms) / len(ms),
            median=percentile(ms, 50.0),
            p90=percentile(ms, 90.0),
            p99=percentile(ms, 99.0),
        )


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_ms is not None and r.ttft * 1000.0 > self.ttft_ms:
            return False
        tpot = r.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and r.e2e * 1000.0 > self.e2e_ms)


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(text: str) -> SLO:
    """``ttft=500ms,tpot=50ms,e2e=2s`` (a bare number is milliseconds)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"bad SLO {part!r}: expected ttft=, tpot= or e2e= followed by a duration")
        m = _DURATION.match(raw)
        if m is None:
            raise ValueError(f"bad SLO duration {raw!r} for {key}: expected e.g. 500ms or 2s")
        if key in values:
            raise ValueError(f"SLO {key} given twice")
        number = float(m.group(1))
        values[key] = number * 1000.0 if m.group(2) == "s" else number
    if not values:
        raise ValueError("empty SLO: expected e.g. ttft=500ms,tpot=50ms")
    return SLO(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2e_ms=values.get("e2e"))


@dataclass(frozen=True)
class Summary:
    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # successful requests / s
    input_throughput: float  # prompt tokens of successful requests / s
    output_throughput: float  # output tokens of successful requests / s
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    slo_attainment: float | None  # fraction of all requests meeting every SLO
    errors: dict[str, int]


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None) -> Summary:
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max(r.end for r in records) - min(r.start for r in records)
    if duration <= 0.0:
        raise ValueError("the run has no duration")
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "")[:120]
        errors[key] = errors.get(key, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    goodput = attainment = None
    if slo is not None and not slo.empty:
        good = sum(1 for r in ok if slo.met_by(r))
        goodput = good / duration
        attainment = good / len(records)
    return Summary(
        duration_s=duration,
        completed=len(ok),
        failed=len(failed),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        ttft=Stats.of_seconds([t for r in ok if (t := r.ttft) is not None]),
        tpot=Stats.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of_seconds([g for r in ok for g in r.itls]),
        e2e=Stats.of_seconds([r.e2e for r in ok]),
        goodput=goodput,
        slo_attainment=attainment,
        errors=errors,
    )
