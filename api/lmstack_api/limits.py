"""Admission control (bounded queue) and per-key token-bucket rate limiting."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmstack_api.config import RateLimitConfig
from lmstack_api.errors import APIError, invalid, overloaded

Clock = Callable[[], float]


class TokenBucket:
    """Holds at most `per_minute` tokens and refills at `per_minute / 60` per second."""

    def __init__(self, per_minute: float, clock: Clock = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.tokens = self.capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, amount: float) -> float:
        """Seconds until `amount` tokens are available (0: now; inf: never, over capacity)."""
        if amount > self.capacity:
            return math.inf
        self._refill()
        return max(0.0, (amount - self.tokens) / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.tokens -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.tokens = min(self.capacity, self.tokens + amount)


@dataclass
class Reservation:
    """What one request took from its key's buckets; `settle` returns the unused part."""

    limiter: RateLimiter | None
    key: str
    output_tokens: int
    settled: bool = False

    def settle(self, used_output_tokens: int) -> None:
        if self.settled or self.limiter is None:
            return
        self.settled = True
        self.limiter._refund(self.key, max(0, self.output_tokens - used_output_tokens))


@dataclass
class _KeyBuckets:
    requests: TokenBucket | None
    input: TokenBucket | None
    output: TokenBucket | None


class RateLimiter:
    """Per-key buckets for requests, input tokens and output tokens per minute. A request
    reserves 1 request, its prompt tokens and its max output tokens at admission; when it
    ends, the output tokens it did not use go back."""

    def __init__(self, config: RateLimitConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._keys: dict[str, _KeyBuckets] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        c = self.config
        return any(
            v is not None
            for v in (c.requests_per_minute, c.input_tokens_per_minute, c.output_tokens_per_minute)
        )

    def _buckets(self, key: str) -> _KeyBuckets:
        b = self._keys.get(key)
        if b is None:
            c = self.config

            def make(rate: int | None) -> TokenBucket | None:
                return TokenBucket(rate, self.clock) if rate is not None else None

            b = self._keys[key] = _KeyBuckets(
                make(c.requests_per_minute), make(c.input_tokens_per_minute), make(c.output_tokens_per_minute)
            )
        return b

    def reserve(self, key: str, input_tokens: int, output_tokens: int) -> Reservation:
        """Take from every bucket or from none: 429 with Retry-After when one is short, 400 when
        the request alone exceeds a per-minute limit (it could never be admitted)."""
        if not self.enabled:
            return Reservation(None, key, 0)
        with self._lock:
            b = self._buckets(key)
            wants = [
                (b.requests, 1, "requests", None),
                (b.input, input_tokens, "input tokens", "prompt"),
                (b.output, output_tokens, "output tokens", "max_tokens"),
            ]
            wait = 0.0
            short = ""
            for bucket, amount, what, param in wants:
                if bucket is None:
                    continue
                w = bucket.wait_time(amount)
                if math.isinf(w):
                    raise invalid(
                        f"this request needs {amount} {what}, more than the limit of "
                        f"{int(bucket.capacity)} {what} per minute",
                        param=param,
                        code="rate_limit_exceeded",
                    )
                if w > wait:
                    wait, short = w, what
            if wait > 0:
                raise APIError(
                    429,
                    f"rate limit reached for {short} per minute; retry in {wait:.1f} s",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    retry_after=wait,
                )
            for bucket, amount, _, _ in wants:
                if bucket is not None:
                    bucket.take(amount)
            return Reservation(self, key, output_tokens if b.output is not None else 0)

    def _refund(self, key: str, output_tokens: int) -> None:
        with self._lock:
            b = self._keys.get(key)
            if b is not None and b.output is not None and output_tokens:
                b.output.give_back(output_tokens)


@dataclass
class Admission:
    """Bounds the requests (and their prompt tokens) admitted but not yet started."""

    max_waiting: int
    max_queued_tokens: int
    waiting: int = 0
    queued_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, prompt_tokens: int) -> Ticket:
        with self._lock:
            if self.waiting + 1 > self.max_waiting:
                raise overloaded(f"server overloaded: {self.waiting} requests are already waiting", 2.0)
            if self.waiting and self.queued_tokens + prompt_tokens > self.max_queued_tokens:
                raise overloaded(
                    f"server overloaded: {self.queued_tokens} prompt tokens are already queued", 2.0
                )
            self.waiting += 1
            self.queued_tokens += prompt_tokens
        return Ticket(self, prompt_tokens)

    def _leave(self, prompt_tokens: int) -> None:
        with self._lock:
            self.waiting -= 1
            self.queued_tokens -= prompt_tokens


@dataclass
class Ticket:
    """A request's place in the queue; `start` (first token, or the end) gives it back once."""

    admission: Admission
    prompt_tokens: int
    done: bool = False

    def start(self) -> None:
        if not self.done:
            self.done = True
            self.admission._leave(self.prompt_tokens)
