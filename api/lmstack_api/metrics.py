"""Prometheus metrics, all named `lmstack:*`.

Engine-wide values (queue depth, KV usage, token counters) are read from the engine's stats
snapshot when scraped; per-request latencies are observed by the API as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from lmstack.outputs import EngineStats

# `*_created` series double the output and no dashboard reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2.5,
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # still loading
            return
        yield GaugeMetricFamily(
            "lmstack:num_requests_running", "Sequences running in the engine", s.num_running
        )
        yield GaugeMetricFamily(
            "lmstack:num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting
        )
        yield GaugeMetricFamily(
            "lmstack:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", s.kv_usage
        )
        used = s.num_kv_blocks - s.num_free_kv_blocks
        yield GaugeMetricFamily("lmstack:kv_cache_blocks_used", "KV-cache blocks in use", used)
        yield GaugeMetricFamily("lmstack:kv_cache_blocks_total", "KV-cache blocks in total", s.num_kv_blocks)
        yield CounterMetricFamily("lmstack:num_preemptions", "Sequences preempted", s.num_preemptions)
        yield CounterMetricFamily(
            "lmstack:prompt_tokens", "Prompt tokens computed (prefill)", s.prompt_tokens
        )
        yield CounterMetricFamily("lmstack:generation_tokens", "Tokens generated", s.generation_tokens)
        fin = CounterMetricFamily(
            "lmstack:request_finished", "Sequences finished, by reason", labels=["finished_reason"]
        )
        for reason, count in sorted(dict(s.finished_by_reason).items()):
            fin.add_metric([reason], count)
        yield fin
        yield CounterMetricFamily(
            "lmstack:spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens
        )
        yield CounterMetricFamily(
            "lmstack:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens
        )
        yield _accepted_length_histogram(s.spec_decode_accepted_lengths)
        yield GaugeMetricFamily(
            "lmstack:spec_decode_draft_length",
            "Mean number of drafts allowed per decoding sequence in the last step (adaptive)",
            s.spec_decode_draft_length,
        )


def _accepted_length_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Drafts accepted per verification, one bucket per length seen (le = 0, 1, ..., +Inf)."""
    top = max(counts, default=0)
    buckets, running = [], 0
    for length in range(top + 1):
        running += counts.get(length, 0)
        buckets.append((str(length), running))
    buckets.append(("+Inf", running))
    total = sum(length * n for length, n in counts.items())
    return HistogramMetricFamily(
        "lmstack:spec_decode_accepted_length",
        "Draft tokens accepted per verified draft",
        buckets=buckets,
        sum_value=total,
    )


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(stats))
        self.ttft = Histogram(
            "lmstack:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "lmstack:inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "lmstack:time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lmstack:e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "lmstack:request_queue_time_seconds",
            "Time from arrival to first scheduling",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "lmstack:http_requests",
            "HTTP API requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.success = Counter("lmstack:request_success", "Requests that finished normally", registry=r)
        self.goodput = Counter(
            "lmstack:request_goodput", "Finished requests that met the TTFT and TPOT objectives", registry=r
        )
        # vLLM's pair: the hit rate is hits / queries (both in prompt tokens).
        self.prefix_queries = Counter(
            "lmstack:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "lmstack:prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prompt_tokens_served = Counter(
            "lmstack:request_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.aborted = Counter(
            "lmstack:request_aborted",
            "Requests aborted (client disconnect, drain timeout, error)",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
