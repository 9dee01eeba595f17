"""What the server holds for its lifetime: the engine, limits, metrics, readiness and drain."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
from collections.abc import Callable
from typing import Any

from lmstack.engine.async_engine import AsyncEngine
from lmstack.errors import EngineDeadError, LmstackError
from lmstack.stack.prepare import PreparedStack
from lmstack.stack.resolve import ResolvedStack
from lmstack_api.chat_template import load_chat_template, with_chat_template
from lmstack_api.config import TENANT_PATTERN, ServerConfig, key_tenants, server_config
from lmstack_api.errors import APIError, clip, overloaded
from lmstack_api.grammar_guard import CompileGuard
from lmstack_api.limits import Admission, RateLimiter
from lmstack_api.logs import get_logger
from lmstack_api.metrics import Metrics
from lmstack_api.prompts import max_piece_bytes

log = get_logger()

_TENANT = re.compile(TENANT_PATTERN)
# Well-formed `X-Request-Id`s are adopted; others are ignored (see `client_request_id`).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def tenant_header(headers: Any) -> str | None:
    """The `X-Tenant` header (servers without API keys); 400 naming it when malformed."""
    value = headers.get("x-tenant")
    if value is None:
        return None
    if not _TENANT.match(value):
        raise APIError(
            400,
            f"X-Tenant header {clip(value)!r} is not a tenant name: use 1-64 characters of A-Z a-z 0-9 . _ -",
            param="X-Tenant",
            code="invalid_header",
        )
    return value


def client_request_id(headers: Any) -> str | None:
    """The caller's `X-Request-Id` when well formed (1-128 characters of A-Z a-z 0-9 . _ : -),
    else None. A malformed one is ignored rather than refused, and the server's own id is
    echoed instead: the header is usually set by a proxy or tracing library the client does
    not control, and a request should not fail over a tracing label."""
    value = headers.get("x-request-id")
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


class ServerState:
    def __init__(
        self,
        stack: ResolvedStack,
        engine: AsyncEngine | None = None,
        *,
        prepared: PreparedStack | None = None,
    ) -> None:
        self.stack = stack
        # What `lmstack serve` already loaded, resolved and opened: the engine builds from it.
        self.prepared = prepared
        self.config: ServerConfig = server_config(stack)
        self.model_name = self.config.served_model_name or stack.config.model
        env_keys = [k.strip() for k in os.environ.get("LMSTACK_API_KEYS", "").split(",") if k.strip()]
        # (key, its tenant); compared in constant time, never logged.
        self.api_keys = [(k.encode(), tenant) for k, tenant in key_tenants(self.config, env_keys)]
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
        self.metrics = Metrics(
            lambda: self.engine.stats() if self.engine is not None else None, self.model_name
        )
        cfg = self.config
        self.grammar_guard = CompileGuard(cfg.grammar_compile_timeout_s, cfg.grammar_compile_memory_mib << 20)
        self.grammar_cache_limited = False
        # server.chat_template, read now: a missing file is one line before the model loads.
        self.chat_template = load_chat_template(cfg.chat_template)
        self._chat_tokenizer = None
        self.max_piece_bytes: int | None = None  # the tokenizer's longest token (prompts.py)
        # Called once if the engine cannot be built: the server exits non-zero (server.py), so
        # a supervisor restarts it instead of probing a process that will never serve.
        self.on_load_failure: Callable[[], None] | None = None
        # Set when the engine died while serving (a worker process gone): /health says 503 and
        # `on_engine_death` makes the server exit non-zero once in-flight requests have failed.
        self.engine_error: str | None = None
        self.on_engine_death: Callable[[], None] | None = None

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
            engine = await asyncio.to_thread(AsyncEngine, self.prepared or self.stack)
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
        loop = asyncio.get_running_loop()
        engine.on_dead = lambda exc: loop.call_soon_threadsafe(self._engine_died, exc)
        if engine.dead is not None:  # died between its build and now
            self._engine_died(engine.dead)
        log.info(
            "engine ready",
            model=self.model_name,
            load_s=round(time.monotonic() - started, 2),
            max_model_len=self.engine.max_model_len,
            kv_blocks=self.engine.num_kv_blocks,
        )

    @property
    def failed(self) -> bool:
        """The engine failed to load, or died while serving."""
        return bool(self.load_error or self.engine_error)

    def _engine_died(self, exc: EngineDeadError) -> None:
        if self.engine_error is not None:
            return
        self.engine_error = str(exc)
        log.error("engine died; exiting", error=self.engine_error, inflight=self.inflight)
        if self.on_engine_death is not None:
            self.on_engine_death()

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
        if self.engine_error is not None:
            raise APIError(503, "the engine stopped; this server is exiting", type="server_error")
        if self.engine is None:
            if self.load_error:  # the reason is in the log, not for clients
                raise APIError(503, "the model failed to load", type="server_error")
            raise overloaded("the model is still loading", retry_after=5.0)
        return self.engine

    def authenticate(self, headers: Any) -> str | None:
        """The caller's API key (None when the server needs none); 401 when missing or wrong."""
        return self._match_key(headers)[0]

    def caller(self, headers: Any) -> tuple[str | None, str | None]:
        """(API key, tenant) of a generation request; 401 when a key is needed and missing or
        wrong.

        With keys configured the tenant is the matching key's, and an `X-Tenant` header is
        ignored: a client must not be able to speak for another tenant (whose prefix cache,
        rate limits or priority it would then share). Without keys nothing is secret, so the
        tenant is the `X-Tenant` header when present (400 when malformed), else None."""
        if not self.api_keys:
            return None, tenant_header(headers)
        return self._match_key(headers)

    def _match_key(self, headers: Any) -> tuple[str | None, str | None]:
        if not self.api_keys:
            return None, None
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
        tenant = None
        for key, key_tenant in self.api_keys:  # every key compared: no early exit to time
            if hmac.compare_digest(given, key) and tenant is None:
                tenant = key_tenant
        if tenant is None:
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return token.strip(), tenant

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {clip(model)!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def chat_tokenizer(self, engine: AsyncEngine):
        """The tokenizer that renders chat requests: the engine's, with server.chat_template's
        template when one is set."""
        if self._chat_tokenizer is None or self._chat_tokenizer[0] is not engine.tokenizer:
            self._chat_tokenizer = (
                engine.tokenizer,
                with_chat_template(engine.tokenizer, self.chat_template),
            )
        return self._chat_tokenizer[1]

    def grammar_compiler(self):
        return self.require_ready().grammar_compiler
