"""`AsyncEngine`: the engine loop in a background thread, requests as async streams."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmstack.engine.llm_engine import LLMEngine, StackSource
from lmstack.errors import EngineDeadError
from lmstack.interfaces import EngineLimits
from lmstack.outputs import EngineStats, RequestOutput
from lmstack.sample.grammar import GrammarCompiler
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request

# How long the loop waits (or until a request arrives) after a step in which the scheduler
# held its work back; short against background_grace_s, long against a spin.
HELD_BACK_WAIT_S = 0.005


class AsyncEngine:
    """One thread owns the engine and runs steps; the event loop only exchanges messages
    with it, so a step never blocks other coroutines.

    Given a stack, the engine is also *built* in that thread (the constructor waits for it):
    torch's CPU kernels run on an OpenMP team per calling thread, and a process whose heavy
    torch work is spread over two threads runs it ~1.5x slower (measured: a bf16 linear at
    M=32 took 105 us from the first thread and 155 us once a second thread had run one), so
    loading and every step stay on one thread."""

    def __init__(self, stack: StackSource | LLMEngine, **kw: Any) -> None:
        self._lock = threading.Lock()  # guards _inbox
        self._inbox: list[tuple[str, Any]] = []
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        # Set (under _lock) when a step raised EngineDeadError: no step can run again, so the
        # loop ends, every request fails and `on_dead` (a server exiting) is called once.
        self.dead: EngineDeadError | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: LLMEngine = stack if isinstance(stack, LLMEngine) else None  # type: ignore[assignment]
        # An engine passed in stays its owner's: shutdown() stops the loop, not that engine.
        self._owns_engine = not isinstance(stack, LLMEngine)
        # The latest metrics snapshot, published by the engine thread (readers never see the
        # live object the engine keeps mutating).
        self._stats: EngineStats | None = None
        # When the loop last came round (monotonic): an idle loop does every 0.5 s, a busy one
        # once per step; `loop_age` reads it for readiness probes.
        self._beat = time.monotonic()
        build = None if isinstance(stack, LLMEngine) else (stack, kw)
        self._thread = threading.Thread(target=self._main, args=(build,), name="lmstack-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def _main(self, build: tuple[StackSource, dict[str, Any]] | None) -> None:
        if build is not None:
            try:
                self.engine = LLMEngine(build[0], **build[1])
            except BaseException as exc:  # re-raised by the constructor, in the caller's thread
                self._build_error = exc
                self._built.set()
                return
        self._publish_stats()
        self._built.set()
        self._run()

    # --- what request handlers may use from any thread ------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Thread-safe; raises InvalidRequestError if xgrammar is not installed."""
        return self.engine.grammar_compiler

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.allocator.num_blocks

    @property
    def block_size(self) -> int:
        return self.engine.allocator.block_size

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        client_request_id: str | None = None,
        cache_salt: str | None = None,
        streamed: bool = True,
    ) -> Request:
        """Validate and tokenize (raises InvalidRequestError naming the field); submit the
        result with `stream`. Thread-safe. `tenant` and `client_request_id` ride on the Request
        for schedulers, caches and hooks to read; `cache_salt` keeps its KV blocks apart
        from those of requests with another salt; `streamed`: whether the caller reads tokens
        as they come (`Request.streamed`: False for a caller that reads only the final result)."""
        return self.engine.make_request(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            tenant=tenant,
            client_request_id=client_request_id,
            cache_salt=cache_salt,
            streamed=streamed,
        )

    def stats(self) -> EngineStats:
        """A copy of the latest metrics snapshot (taken after the last step or admission)."""
        snap = self._stats
        assert snap is not None, "the engine thread publishes a snapshot before the constructor returns"
        return snap.snapshot()

    def loop_age(self) -> float | None:
        """Seconds since the engine loop last came round: at most ~0.5 s when idle, the running
        step's time when busy. None once the loop has ended (stopped, dead, or crashed)."""
        if not self._thread.is_alive():
            return None
        return time.monotonic() - self._beat

    def get_stats(self) -> EngineStats:
        return self.stats()

    async def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, **kw: Any
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raises InvalidRequestError; keywords as `make_request`), then yield
        outputs as they arrive; the last one has `finished=True`. Leaving the iteration early
        aborts the request."""
        return self._stream(self.make_request(prompt, params, **kw))

    def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request made (and validated) with `make_request`; same stream as
        `add_request`."""
        return self._stream(req)

    async def _stream(self, req) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (asyncio.get_running_loop(), queue)
        if not self._post("add", req):
            self._streams.pop(req.request_id, None)
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self._post("abort", req.request_id)

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def _publish_stats(self) -> None:
        # get_stats() is a snapshot: readers never see the object the engine keeps mutating.
        self._stats = self.engine.get_stats()

    def _post(self, kind: str, payload: Any) -> bool:
        """False when the engine is dead (nothing will read the inbox again)."""
        with self._lock:
            if self.dead is not None:
                return False
            self._inbox.append((kind, payload))
        self._wake.set()
        return True

    def _run(self) -> None:
        eng = self.engine
        while not self._stopped:
            self._beat = time.monotonic()
            with self._lock:
                inbox, self._inbox = self._inbox, []
                self._wake.clear()
            for kind, payload in inbox:
                if kind == "add":
                    eng.enqueue(payload)
                elif kind == "abort":
                    eng.abort(payload)
            if inbox:
                self._publish_stats()  # aborts free blocks now; keep the metrics snapshot current
            if not eng.has_unfinished():
                self._wake.wait(timeout=0.5)
                continue
            steps = eng.stats.num_steps
            try:
                outputs = eng.step()
            except BaseException as exc:  # a failed step must not hang the clients
                self._error = exc
                if isinstance(exc, EngineDeadError):
                    self._die(exc)
                    return
                for rid in list(eng.requests):
                    eng.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {exc}"))
                self._publish_stats()
                continue
            self._publish_stats()
            for out in outputs:
                self._deliver(out.request_id, out)
            if not outputs and eng.stats.num_steps == steps:
                # The scheduler held its work back this step (background work in the grace
                # after interactive work): wait a moment, or for a request, instead of spinning.
                self._wake.wait(timeout=HELD_BACK_WAIT_S)

    def _die(self, exc: EngineDeadError) -> None:
        with self._lock:
            self.dead = exc
            inbox, self._inbox = self._inbox, []
        eng = self.engine
        failed = [p.request_id for kind, p in inbox if kind == "add"] + list(eng.requests)
        for rid in list(eng.requests):
            eng.abort(rid)
        for rid in dict.fromkeys(failed):
            self._deliver(rid, EngineDeadError(f"the engine stopped: {exc}"))
        self._publish_stats()
        if self.on_dead is not None:
            self.on_dead(exc)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._owns_engine:
            self.engine.shutdown()
