"""Token buckets, per-key rate limiting and admission bounds, with a controlled clock."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lmstack_api")
from lmstack_api.config import RateLimitConfig  # noqa: E402
from lmstack_api.errors import APIError  # noqa: E402
from lmstack_api.limits import Admission, RateLimiter, TokenBucket  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bucket_refills_at_the_per_minute_rate_up_to_capacity():
    clock = Clock()
    b = TokenBucket(60, clock)  # one token per second
    b.take(60)
    assert b.wait_time(1) == pytest.approx(1.0)
    assert b.wait_time(30) == pytest.approx(30.0)
    clock.t += 10
    assert b.wait_time(10) == 0.0
    assert b.wait_time(11) == pytest.approx(1.0)
    clock.t += 1000
    assert b.tokens <= 60 and b.wait_time(60) == 0.0
    assert math.isinf(b.wait_time(61))


def test_reserve_takes_from_all_buckets_or_none_and_reports_retry_after():
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(requests_per_minute=10, input_tokens_per_minute=100), clock)
    rl.reserve("k", 80, 5)
    with pytest.raises(APIError) as e:
        rl.reserve("k", 30, 5)  # input short by 10 tokens; 100/min refills 10 in 6 s
    assert e.value.status == 429 and e.value.retry_after == pytest.approx(6.0)
    assert e.value.headers() == {"Retry-After": "6"}
    # The failed attempt took nothing: the request bucket still holds 9.
    assert rl._keys["k"].requests.tokens == pytest.approx(9)
    rl.reserve("other", 100, 0)  # keys are independent
    clock.t += 6
    rl.reserve("k", 30, 5)


def test_unused_output_tokens_are_refunded_once():
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(output_tokens_per_minute=1000), clock)
    r = rl.reserve("k", 10, 800)
    with pytest.raises(APIError):
        rl.reserve("k", 10, 800)
    r.settle(100)  # used 100 of 800: 700 come back -> 900 available
    r.settle(0)  # idempotent
    assert rl._keys["k"].output.tokens == pytest.approx(900)
    rl.reserve("k", 10, 900)


def test_a_request_larger_than_a_whole_minute_is_400_not_429():
    rl = RateLimiter(RateLimitConfig(output_tokens_per_minute=100), Clock())
    with pytest.raises(APIError) as e:
        rl.reserve("k", 1, 101)
    assert e.value.status == 400 and e.value.param == "max_tokens" and e.value.retry_after is None


def test_no_limits_configured_reserves_nothing():
    rl = RateLimiter(RateLimitConfig(), Clock())
    for _ in range(1000):
        rl.reserve("k", 10**6, 10**6).settle(0)
    assert not rl._keys


def test_admission_bounds_waiting_requests_and_queued_tokens():
    adm = Admission(max_waiting=2, max_queued_tokens=100)
    a = adm.admit(60)
    with pytest.raises(APIError) as e:
        adm.admit(50)  # 110 queued tokens
    assert e.value.status == 503 and e.value.retry_after
    b = adm.admit(40)
    with pytest.raises(APIError):
        adm.admit(1)  # 3 waiting
    a.start()
    a.start()  # once only
    assert (adm.waiting, adm.queued_tokens) == (1, 40)
    b.start()
    big = adm.admit(500)  # an empty queue admits even an oversized prompt
    big.start()
    assert (adm.waiting, adm.queued_tokens) == (0, 0)
