"""The serving benchmark's arithmetic, against hand-computed cases."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from lmstack_bench.metrics import SLO, RequestRecord, Stats, parse_slo, percentile, summarize


def record(start, chunks, end, output_tokens, prompt_tokens=10, error=None) -> RequestRecord:
    return RequestRecord(
        start=start,
        end=end,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        first_token=chunks[0] if chunks else None,
        chunk_times=list(chunks),
        error=error,
    )


def test_percentile_interpolates_between_closest_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)


def test_percentile_matches_numpy_default_on_random_samples():
    rng = random.Random(1234)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 37.5, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ttft_tpot_itl_e2e_of_one_request():
    r = record(10.0, [10.5, 10.7, 11.0, 11.6], 11.7, output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.7)
    assert r.tpot == pytest.approx((1.7 - 0.5) / 3)  # 0.4: the decode time over the 3 later tokens
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])


def test_tpot_counts_tokens_but_itl_counts_chunks():
    # 6 tokens in 4 chunks (a speculative server sends several tokens at once): TPOT spreads the
    # decode time over 5 tokens, ITL still has one gap per pair of chunks.
    r = record(0.0, [0.2, 0.5, 0.9, 1.4], 1.4, output_tokens=6)
    assert r.tpot == pytest.approx((1.4 - 0.2) / 5)
    assert r.itls == pytest.approx([0.3, 0.4, 0.5])


def test_tpot_undefined_below_two_tokens_and_without_a_first_token():
    assert record(0.0, [0.3], 0.3, output_tokens=1).tpot is None
    assert record(0.0, [], 1.0, output_tokens=0, error="HTTP 500").ttft is None


def test_stats_are_milliseconds():
    s = Stats.of_seconds([0.1, 0.2, 0.3, 0.4])
    assert s == Stats(count=4, mean=pytest.approx(250.0), median=pytest.approx(250.0),
                      p90=pytest.approx(370.0), p99=pytest.approx(397.0))  # fmt: skip
    assert Stats.of_seconds([]) is None


def test_summary_throughputs_goodput_and_errors():
    a = record(0.0, [0.5, 0.9, 1.3, 1.7], 1.7, output_tokens=4, prompt_tokens=100)  # TPOT 0.4
    b = record(1.0, [1.2, 1.3, 1.4], 1.4, output_tokens=3, prompt_tokens=50)  # TPOT 0.1
    c = record(2.0, [], 4.0, output_tokens=0, error="HTTP 503: overloaded")
    s = summarize([a, b, c], parse_slo("ttft=600ms,tpot=300ms"))
    assert s.duration_s == pytest.approx(4.0)  # first start 0.0 .. last end 4.0
    assert (s.completed, s.failed) == (2, 1)
    assert (s.input_tokens, s.output_tokens) == (150, 7)
    assert s.request_throughput == pytest.approx(2 / 4.0)
    assert s.output_throughput == pytest.approx(7 / 4.0)
    assert s.input_throughput == pytest.approx(150 / 4.0)
    assert s.ttft.median == pytest.approx(350.0)  # 500 and 200 ms
    assert s.tpot.mean == pytest.approx(250.0)  # 400 and 100 ms
    assert s.itl.count == 5 and s.itl.median == pytest.approx(400.0)  # 400 400 400 100 100
    assert s.e2e.p99 == pytest.approx(1700.0 - 0.01 * 1300.0)
    # Only b meets both objectives (a misses TPOT); the failed request counts against attainment.
    assert s.goodput == pytest.approx(1 / 4.0)
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.errors == {"HTTP 503: overloaded": 1}


def test_goodput_absent_without_slo_and_single_token_requests_meet_tpot():
    one = record(0.0, [0.1], 0.1, output_tokens=1)
    assert summarize([one]).goodput is None
    assert SLO(ttft_ms=200, tpot_ms=1).met_by(one)
    assert not SLO(ttft_ms=50).met_by(one)
    assert not SLO(e2e_ms=50).met_by(one)
    assert SLO(e2e_ms=100).met_by(one)


def test_parse_slo():
    assert parse_slo("ttft=500ms,tpot=50ms") == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_slo("e2e=2s") == SLO(e2e_ms=2000.0)
    assert parse_slo(" TTFT = 0.25s , tpot=40 ") == SLO(ttft_ms=250.0, tpot_ms=40.0)
    for bad in ("", "ttft", "latency=1ms", "ttft=fast", "ttft=1ms,ttft=2ms", "ttft=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_summarize_rejects_nothing():
    with pytest.raises(ValueError):
        summarize([])


def test_turn_and_cached_tokens_survive_the_json_round_trip():
    from lmstack_bench.report import BenchResult, RunResult, result_from_json
    from lmstack_bench.runner import LoadSpec

    a = RequestRecord(start=0.0, end=1.0, first_token=0.2, chunk_times=[0.2], turn=0, cached_tokens=0)
    b = RequestRecord(start=1.0, end=2.0, first_token=1.1, chunk_times=[1.1], turn=1, cached_tokens=320)
    load = LoadSpec(concurrency=1, num_requests=2)
    res = BenchResult("x", "http://x", "m", {}, [RunResult.of(load, [a, b], None)])
    back = result_from_json(json.loads(json.dumps(res.to_json())))
    assert [(r.turn, r.cached_tokens) for r in back.runs[0].records] == [(0, 0), (1, 320)]
