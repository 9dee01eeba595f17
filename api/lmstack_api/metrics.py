"""Prometheus metrics, all named `lmstack:*`, each labelled `model_name` (the served model name,
as /v1/models reports it), so that several models behind one Prometheus can be told apart.

Engine-wide values (queue depth, KV usage, token counters) are read from the engine's stats
snapshot when scraped; per-request latencies are observed by the API as requests finish.
deploy/grafana and deploy/prometheus query these names (tests/test_deploy.py checks them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from lmstack.outputs import EngineStats

# vLLM's label name, so that dashboards written for it read the same way.
MODEL_LABEL = "model_name"

# `*_created` series double the output and no dashboard reads them.
disable_created_metrics()

# 2 s is the default TTFT objective (server.slo.ttft_ms) and 0.2 s in the token buckets the
# default TPOT one: the SLO-burn alerts (deploy/prometheus/alerts.yaml) count requests at
# those bounds, which must be bucket edges.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 40, 80, 160)
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
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def _one(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(name, doc, labels=[MODEL_LABEL])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # still loading
            return
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._one(
            gauge, "lmstack:num_requests_running", "Sequences running in the engine", s.num_running
        )
        yield self._one(
            gauge, "lmstack:num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting
        )
        yield self._one(
            gauge, "lmstack:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", s.kv_usage
        )
        used = s.num_kv_blocks - s.num_free_kv_blocks
        yield self._one(gauge, "lmstack:kv_cache_blocks_used", "KV-cache blocks in use", used)
        yield self._one(gauge, "lmstack:kv_cache_blocks_total", "KV-cache blocks in total", s.num_kv_blocks)
        yield self._one(counter, "lmstack:num_preemptions", "Sequences preempted", s.num_preemptions)
        # Steps the engine ran: a rate of zero while requests run is an engine that stopped
        # stepping (deploy/prometheus/alerts.yaml, LmstackEngineStalled).
        yield self._one(counter, "lmstack:engine_steps", "Engine steps run", s.num_steps)
        yield self._one(counter, "lmstack:prompt_tokens", "Prompt tokens computed (prefill)", s.prompt_tokens)
        yield self._one(counter, "lmstack:generation_tokens", "Tokens generated", s.generation_tokens)
        fin = CounterMetricFamily(
            "lmstack:request_finished",
            "Sequences finished, by reason",
            labels=[MODEL_LABEL, "finished_reason"],
        )
        for reason, count in sorted(dict(s.finished_by_reason).items()):
            fin.add_metric([self.model_name, reason], count)
        yield fin
        yield self._one(
            counter, "lmstack:spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens
        )
        yield self._one(
            counter, "lmstack:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens
        )
        yield _accepted_length_histogram(s.spec_decode_accepted_lengths, self.model_name)
        yield self._one(
            gauge,
            "lmstack:spec_decode_draft_length",
            "Mean number of drafts allowed per decoding sequence in the last step (adaptive)",
            s.spec_decode_draft_length,
        )


def _accepted_length_histogram(counts: dict[int, int], model_name: str) -> HistogramMetricFamily:
    """Drafts accepted per verification, one bucket per length seen (le = 0, 1, ..., +Inf)."""
    top = max(counts, default=0)
    buckets, running = [], 0
    for length in range(top + 1):
        running += counts.get(length, 0)
        buckets.append((str(length), running))
    buckets.append(("+Inf", running))
    total = sum(length * n for length, n in counts.items())
    family = HistogramMetricFamily(
        "lmstack:spec_decode_accepted_length",
        "Draft tokens accepted per verified draft",
        labels=[MODEL_LABEL],
    )
    family.add_metric([model_name], buckets=buckets, sum_value=total)
    return family


class _ForModel:
    """A metric with more labels than `model_name`, that label already filled in:
    `.labels(endpoint, status)` gives the child for this server's model."""

    def __init__(self, metric: Counter, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)


class Metrics:
    """The server's registry. Its attributes are this model's series: callers `observe` /
    `inc` them without naming the model."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        r.register(_EngineCollector(stats, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, [MODEL_LABEL], buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, [MODEL_LABEL], registry=r).labels(model_name)

        self.ttft = histogram("lmstack:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram(
            "lmstack:inter_token_latency_seconds",
            "Time between consecutive output tokens",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "lmstack:time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "lmstack:e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS
        )
        self.queue = histogram(
            "lmstack:request_queue_time_seconds", "Time from arrival to first scheduling", _LATENCY_BUCKETS
        )
        self.requests = _ForModel(
            Counter(
                "lmstack:http_requests",
                "HTTP API requests by endpoint and status",
                [MODEL_LABEL, "endpoint", "status"],
                registry=r,
            ),
            model_name,
        )
        self.success = counter("lmstack:request_success", "Requests that finished normally")
        self.goodput = counter(
            "lmstack:request_goodput", "Finished requests that met the TTFT and TPOT objectives"
        )
        # vLLM's pair: the hit rate is hits / queries (both in prompt tokens).
        self.prefix_queries = counter(
            "lmstack:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter("lmstack:prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.prompt_tokens_served = counter(
            "lmstack:request_prompt_tokens", "Prompt tokens of admitted requests"
        )
        self.aborted = counter(
            "lmstack:request_aborted", "Requests aborted (client disconnect, drain timeout, error)"
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
