"""What the server holds for its lifetime: the engine, limits, metrics, readiness and drain."""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import Callable
from typing import Any

from lmstack.async_engine import AsyncEngine
from lmstack.errors import LmstackError
from lmstack.resolve import ResolvedStack
from lmstack_api.config import ServerConfig, server_config
from lmstack_api.errors import APIError, clip, overloaded
from lmstack_api.grammar_guard import CompileGuard
from lmstack_api.limits import Admission, RateLimiter
from lmstack_api.logs import get_logger
from lmstack_api.metrics import Metrics
from lmstack_api.prompts import max_piece_bytes

log = get_logger()


class ServerState:
    def __init__(self, stack: ResolvedStack, engine: AsyncEngine | None = None) -> None:
        self.stack = stack
        self.config: ServerConfig = server_config(stack)
        self.model_name = self.config.served_model_name or stack.config.model
        env_keys = [k.strip() for k in os.environ.get("LMSTACK_API_KEYS", "").split(",") if k.strip()]
        self.api_keys = [k.encode() for k in (*self.config.api_keys, *env_keys)]
        self.engine = engine
        self.load_error: str | None = None
        # The exception itself: `lmstack serve` reports an LmstackError (a factory's BuildError)
        # as the CLI's one line when it exits.
        self.load_exception: BaseException | None = None
        self.created = int(time.time())
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.admission = Admission(self.config.max_waiting_requests, self.config.max_queued_tokens)
        self.limiter = RateLimiter(self.config.rate_limit)
        self.metrics = Metrics(lambda: self.engine.stats() if self.engine is not None else None)
        cfg = self.config
        self.grammar_guard = CompileGuard(cfg.grammar_compile_timeout_s, cfg.grammar_compile_memory_mib << 20)
        self.grammar_cache_limited = False
        self.max_piece_bytes: int | None = None  # the tokenizer's longest token (prompts.py)
        # Called once if the engine cannot be built: the server exits non-zero (server.py), so
        # a supervisor restarts it instead of probing a process that will never serve.
        self.on_load_failure: Callable[[], None] | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    async def load(self) -> None:
        """Build the engine off the event loop, so /health answers (503) while weights load."""
        if self.engine is not None:
            return
        started = time.monotonic()
        try:
            engine = await asyncio.to_thread(AsyncEngine, self.stack)
            self.max_piece_bytes = await asyncio.to_thread(max_piece_bytes, engine.tokenizer)
        except Exception as exc:  # logged once, here; then the process exits non-zero
            self.load_exception = exc
            self.load_error = str(exc) if isinstance(exc, LmstackError) else f"{type(exc).__name__}: {exc}"
            log.error("engine failed to load; exiting", error=self.load_error)
            log.debug("engine load traceback", exc_info=exc)
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        self.engine = engine
        log.info(
            "engine ready",
            model=self.model_name,
            load_s=round(time.monotonic() - started, 2),
            max_model_len=self.engine.max_model_len,
            kv_blocks=self.engine.num_kv_blocks,
        )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining", inflight=self.inflight, timeout_s=self.config.drain_timeout_s)

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    # --- per-request checks -------------------------------------------------------------------

    def require_ready(self) -> AsyncEngine:
        if self.draining:
            raise overloaded("the server is shutting down and admits no new requests", retry_after=5.0)
        if self.engine is None:
            if self.load_error:  # the reason is in the log, not for clients
                raise APIError(503, "the model failed to load", type="server_error")
            raise overloaded("the model is still loading", retry_after=5.0)
        return self.engine

    def authenticate(self, headers: Any) -> str | None:
        """The caller's API key (None when the server needs none); 401 when missing or wrong."""
        if not self.api_keys:
            return None
        auth = headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        given = token.strip().encode()
        if not any(hmac.compare_digest(given, key) for key in self.api_keys):
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return token.strip()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {clip(model)!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def grammar_compiler(self):
        return self.require_ready().grammar_compiler
