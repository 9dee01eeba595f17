"""One API call on its way through the engine: its engine requests (one per prompt), the
reservations it holds, and the bookkeeping done when it ends however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from lmstack.errors import InvalidRequestError
from lmstack.outputs import RequestOutput
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request
from lmstack_api.logs import get_logger
from lmstack_api.params import request_error
from lmstack_api.state import ServerState

log = get_logger()


# How a job's outcome is counted in `lmstack:http_requests_total{status}` (499: client left).
_STATUS_CODES = {"ok": "200", "disconnected": "499", "engine_error": "500", "error": "500"}


class EngineFailure(Exception):
    """The engine ended a request with an error of its own (not the client's fault)."""


class Job:
    def __init__(
        self,
        state: ServerState,
        endpoint: str,
        request_id: str,
        api_key: str | None,
        *,
        tenant: str | None = None,
        client_request_id: str | None = None,
    ) -> None:
        self.state = state
        self.endpoint = endpoint
        # Unique per job (the engine keys its requests by it); the caller's own id, which may
        # repeat, travels beside it as `client_request_id`.
        self.request_id = request_id
        self.key = api_key  # for the rate limiter only: never on a Request, never logged
        self.tenant = tenant
        self.client_request_id = client_request_id
        self.reqs: list[Request] = []
        self.final: dict[int, RequestOutput] = {}
        self.status = "ok"
        self._reservation = None
        self._ticket = None
        self._entered = False
        self._done = False
        self._last_token_time: dict[int, float] = {}

    @property
    def echo_id(self) -> str:
        """The `X-Request-Id` the response carries: the caller's when adopted, else ours."""
        return self.client_request_id or self.request_id

    def admit(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        client: str,
        cache_salt: str | None = None,
        streamed: bool = True,
        priority: int = 0,
    ) -> None:
        """Tokenize and validate every prompt, then take the queue slot and rate-limit budget;
        raises APIError (400 / 429 / 503) and holds nothing when it does. `streamed`: the
        client reads tokens as they come (SSE), so the scheduler bounds the gaps between them;
        `priority`: the engine requests' (lower runs first under a priority scheduler)."""
        state = self.state
        engine = state.require_ready()
        try:
            for i, prompt in enumerate(prompts):
                rid = self.request_id if len(prompts) == 1 else f"{self.request_id}-{i}"
                self.reqs.append(
                    engine.make_request(
                        prompt,
                        params,
                        request_id=rid,
                        tenant=self.tenant,
                        client_request_id=self.client_request_id,
                        cache_salt=cache_salt,
                        streamed=streamed,
                        priority=priority,
                    )
                )
        except InvalidRequestError as exc:
            raise request_error(exc) from None
        if len(self.reqs) > 1:  # one call's prompts share the engine as one (fair scheduling)
            for r in self.reqs:
                r.group = self.request_id
        prompt_tokens = sum(r.prompt_len for r in self.reqs)
        limit = engine.max_model_len
        max_out = sum(params.n * (params.max_tokens or limit - r.prompt_len) for r in self.reqs)
        ticket = state.admission.admit(prompt_tokens)
        try:
            self._reservation = state.limiter.reserve(self.key or client, prompt_tokens, max_out)
        except BaseException:
            ticket.start()
            raise
        self._ticket = ticket
        state.enter()
        self._entered = True
        state.metrics.prompt_tokens_served.inc(prompt_tokens)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them, all prompts interleaved. Leaving
        early aborts whatever is still running."""
        engine = self.state.engine
        if len(self.reqs) == 1:
            async for out in engine.stream(self.reqs[0]):
                yield 0, self._observe(0, out)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: Request) -> None:
            try:
                async for out in engine.stream(req):
                    await queue.put((i, out))
            except Exception as exc:  # handed to the consumer, which re-raises it
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, self._observe(i, item)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, i: int, out: RequestOutput) -> RequestOutput:
        if out.error:
            raise EngineFailure(out.error)
        new = sum(len(c.token_ids_delta) for c in out.outputs)
        if new:
            now = time.monotonic()
            if self._ticket is not None:
                self._ticket.start()  # out of the queue once its first token exists
            last = self._last_token_time.get(i)
            if last is not None:
                gap = (now - last) / new
                for _ in range(new):
                    self.state.metrics.itl.observe(gap)
            self._last_token_time[i] = now
        if out.finished:
            self.final[i] = out
        return out

    def finish(self, status: str | None = None) -> None:
        """Release everything and record the outcome; safe to call more than once."""
        if self._done:
            return
        self._done = True
        if status is not None:
            self.status = status
        state, m = self.state, self.state.metrics
        if self._ticket is not None:
            self._ticket.start()
        used = sum(len(c.token_ids) for o in self.final.values() for c in o.outputs)
        if self._reservation is not None:
            self._reservation.settle(used)
        if self._entered:
            state.leave()
        m.requests.labels(self.endpoint, _STATUS_CODES.get(self.status, "500")).inc()
        if not self.reqs:
            return
        if self.status != "ok":
            m.aborted.inc()
        ttfts, tpots, reasons = [], [], []
        for o in self.final.values():
            t = o.metrics
            if t.first_scheduled_time is not None:
                m.queue.observe(t.first_scheduled_time - t.arrival_time)
            if t.first_token_time is not None and self.status == "ok":
                ttft = t.first_token_time - t.arrival_time
                e2e = (t.finished_time or time.monotonic()) - t.arrival_time
                n_out = max(len(c.token_ids) for c in o.outputs)
                tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else 0.0
                m.ttft.observe(ttft)
                m.e2e.observe(e2e)
                if n_out > 1:
                    m.tpot.observe(tpot)
                ttfts.append(ttft)
                tpots.append(tpot)
            m.prefix_queries.inc(len(o.prompt_token_ids))
            m.prefix_hits.inc(o.num_cached_tokens)
            reasons.extend(c.finish_reason for c in o.outputs)
        complete = self.status == "ok" and len(self.final) == len(self.reqs)
        if complete:
            m.success.inc()
            slo = state.config.slo
            if all(t * 1000 <= slo.ttft_ms for t in ttfts) and all(t * 1000 <= slo.tpot_ms for t in tpots):
                m.goodput.inc()
        first = self.reqs[0]
        log.info(
            "request finished",
            request_id=self.request_id,
            # Read back from the engine's Request: what schedulers and caches saw.
            client_request_id=first.client_request_id,
            tenant=first.tenant,
            endpoint=self.endpoint,
            status=self.status,
            prompt_tokens=sum(r.prompt_len for r in self.reqs),
            cached_tokens=sum(o.num_cached_tokens for o in self.final.values()),
            completion_tokens=used,
            n=first.params.n,
            finish_reason=",".join(sorted({str(r) for r in reasons})) or None,
            ttft_s=round(max(ttfts), 4) if ttfts else None,
            tpot_s=round(max(tpots), 5) if tpots else None,
            e2e_s=round(time.monotonic() - first.arrival_time, 4),
        )
