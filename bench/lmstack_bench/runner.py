"""Drive a server with sessions: closed loop at a fixed concurrency, or open loop at a rate.

Closed loop: `concurrency` clients each start their next session as soon as the previous one
ends. Open loop: sessions start at Poisson (or evenly spaced) arrival times whatever the server
does, optionally capped at `max_concurrency` in flight. Either stops issuing requests once
`num_requests` were sent or `duration_s` passed, then waits for the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from lmstack_bench.client import RequestOptions, send
from lmstack_bench.metrics import RequestRecord
from lmstack_bench.workloads import Session

ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop: sessions started per second
    arrivals: str = "poisson"
    max_concurrency: int | None = None  # open loop: cap on sessions in flight
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of a concurrency (closed loop) and a request rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"request rate must be positive, got {self.rate}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.arrivals!r}; choose poisson or constant")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("bound the run with a number of requests, a duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the number of requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("the duration must be positive")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"{self.rate:g} req/s ({self.arrivals})"


class _Budget:
    """How many more requests may be issued."""

    def __init__(self, spec: LoadSpec) -> None:
        self.left = spec.num_requests
        self.deadline = None if spec.duration_s is None else time.perf_counter() + spec.duration_s

    def open(self) -> bool:
        if self.left is not None and self.left <= 0:
            return False
        return self.deadline is None or time.perf_counter() < self.deadline

    def take(self) -> bool:
        if not self.open():
            return False
        if self.left is not None:
            self.left -= 1
        return True


class Runner:
    def __init__(
        self,
        base_url: str,
        opts: RequestOptions,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        progress: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.opts = opts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.progress = progress

    def run(
        self, sessions: Iterator[Session], load: LoadSpec, desc: str | None = None
    ) -> list[RequestRecord]:
        """Run one load point; `desc` names it on the progress bar (default: the load)."""
        return asyncio.run(self._run(sessions, load, desc or load.label))

    async def _run(self, sessions: Iterator[Session], load: LoadSpec, desc: str) -> list[RequestRecord]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers) as client:
            records: list[RequestRecord] = []
            bar = tqdm(
                total=load.num_requests,
                desc=desc,
                unit="req",
                file=sys.stderr,
                disable=not self.progress,
                leave=False,
            )
            try:
                budget = _Budget(load)
                if load.concurrency is not None:
                    await self._closed(client, sessions, load.concurrency, budget, records, bar)
                else:
                    await self._open(client, sessions, load, budget, records, bar)
            finally:
                bar.close()
            return records

    async def _session(
        self,
        client: httpx.AsyncClient,
        session: Session,
        budget: _Budget,
        records: list[RequestRecord],
        bar: tqdm,
        first_reserved: bool = False,
    ) -> None:
        history: list[dict[str, str]] = []
        if session.system is not None:
            history.append({"role": "system", "content": session.system})
        for i, turn in enumerate(session.turns):
            if not (first_reserved and i == 0) and not budget.take():
                return
            messages = [*history, {"role": "user", "content": turn.user}]
            reply = await send(
                client, self.base_url, self.opts, messages, turn.max_tokens, turn.expected_prompt_tokens
            )
            reply.record.turn = i
            records.append(reply.record)
            bar.update(1)
            if not reply.record.ok:
                return  # a conversation does not go on after a failed turn
            history = [*messages, {"role": "assistant", "content": reply.text}]

    async def _closed(
        self,
        client: httpx.AsyncClient,
        sessions: Iterator[Session],
        concurrency: int,
        budget: _Budget,
        records: list[RequestRecord],
        bar: tqdm,
    ) -> None:
        async def worker() -> None:
            while budget.open():
                await self._session(client, next(sessions), budget, records, bar)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _open(
        self,
        client: httpx.AsyncClient,
        sessions: Iterator[Session],
        load: LoadSpec,
        budget: _Budget,
        records: list[RequestRecord],
        bar: tqdm,
    ) -> None:
        assert load.rate is not None
        rng = random.Random(load.seed)
        # No cap: a context that admits everyone, so one code path serves both cases.
        gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()

        async def start(session: Session) -> None:
            async with gate:
                await self._session(client, session, budget, records, bar, first_reserved=True)

        tasks: list[asyncio.Task[None]] = []
        next_at = None
        while budget.take():
            session = next(sessions)  # drawn first: building it must not eat into the schedule
            next_at = time.perf_counter() if next_at is None else next_at
            tasks.append(asyncio.create_task(start(session)))
            gap = rng.expovariate(load.rate) if load.arrivals == "poisson" else 1.0 / load.rate
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks)
