"""`lmstack serve`: one process that owns the engine and serves HTTP with uvicorn.

SIGTERM (or Ctrl-C) starts a drain: new requests get 503, in-flight ones run to completion for
up to `server.drain_timeout_s`, then the process exits with status 0. A second Ctrl-C exits
at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Sequence
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmstack.errors import LmstackError
from lmstack.exec.multiproc import launched, run_launched_worker
from lmstack.stack.config import load_stack
from lmstack.stack.overrides import parse_overrides
from lmstack.stack.plugins import make_plugin_manager
from lmstack.stack.prepare import prepare_stack, resolve_stack
from lmstack_api.app import create_app
from lmstack_api.config import server_config
from lmstack_api.logs import configure_logging, get_logger
from lmstack_api.state import ServerState
from lmstack_api.tool_parsers import check_tool_parser

log = get_logger()


_TIMEOUT_BODY = b'{"error": {"message": "the request headers did not arrive in time", "type": "invalid_request_error", "param": null, "code": "request_timeout"}}'
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on the request head: a connection that has not
    sent a complete request line and headers within `timeout_s` of opening (or of its previous
    response) gets 408 and is closed. uvicorn itself only times out idle keep-alive
    connections, so a client trickling a byte a second would hold its socket forever."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_TIMEOUT_RESPONSE)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # IDLE: h11 is still reading a request head (or awaits the next one).
            if self.conn.their_state is h11.IDLE:
                self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # The next request's head starts when its first byte arrives (data_received);
            # until then uvicorn's keep-alive timeout applies.
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread, which is the event loop's; not re-raised afterwards, so a
        # drained shutdown exits 0.
        if self._drain_task is not None:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain(signal.Signals(sig).name))

    async def _drain(self, name: str) -> None:
        state = self.state
        log.info("shutdown requested", signal=name, inflight=state.inflight)
        state.start_draining()
        state.grammar_guard.close()  # a compile in progress ends now; its request gets 503
        if not await state.wait_idle(state.config.drain_timeout_s):
            log.warning("drain timeout: aborting in-flight requests", inflight=state.inflight)
        self.should_exit = True

    async def exit_after_engine_death(self) -> None:
        # In-flight requests have been handed their errors; let their responses go out, and keep
        # answering /health with 503 a moment so probes and balancers see it, then exit.
        await self.state.wait_idle(5.0)
        await asyncio.sleep(1.0)
        self.should_exit = True


def serve(
    stack_path: str,
    host: str | None = None,
    port: int | None = None,
    log_level: str = "info",
    overrides: Sequence[str] = (),
) -> int:
    """Serve `stack_path` (a stack file, or a model alone), with `overrides` (`--set KEY=VALUE`)."""
    configure_logging(log_level)
    launch = launched()
    if launch is not None and launch.rank != 0:
        # Under torchrun every rank runs `lmstack serve`: global rank 0 serves HTTP and drives
        # the engine, the others are its workers (they get everything else from rank 0).
        return run_launched_worker()
    # This distribution's own plugin (the `server:` section) even when autoload is off.
    pm = make_plugin_manager(extra_plugins=["lmstack_api.plugin"])
    stack = resolve_stack(load_stack(stack_path, parse_overrides(overrides)), pm)
    check_tool_parser(server_config(stack), pm)  # an unknown name is one line, before the model loads
    if launch is not None and launch.world_size > 1 and stack.parallel.component.name == "single":
        # Its other ranks would wait for a rank 0 that never joins them.
        raise LmstackError(
            f"the launcher started WORLD_SIZE={launch.world_size} ranks, but the stack's parallel "
            "layout is `single` (one process); select a parallel layout with that many ranks"
        )
    # The model's metadata (no weights) against the stack: conflicts stop here, in one line. The
    # engine gets this pass as it is (the model file is opened once in this process).
    prepared = prepare_stack(stack, plugin_manager=pm)
    cfg = server_config(stack)
    host = host or cfg.host
    # Bind before anything loads, so a port in use is one line now, not an error after the
    # weights are in memory.
    sock = _listen(host, port if port is not None else cfg.port)
    state = ServerState(stack, prepared=prepared)
    config = uvicorn.Config(
        create_app(stack, state),
        host=host,
        port=sock.getsockname()[1],
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=header_timeout_protocol(cfg.header_timeout_s),
    )
    log.info("serving", model=state.model_name, host=host, port=config.port, stack=stack_path)
    server = _DrainingServer(config, state)

    def failed() -> None:
        server.should_exit = True

    state.on_load_failure = failed
    state.on_engine_death = lambda: asyncio.ensure_future(server.exit_after_engine_death())
    server.run(sockets=[sock])
    # A server that cannot serve exits non-zero (its reason was logged once), so a supervisor
    # restarts it or reports it rather than probing a process stuck at 503 forever. A problem
    # the user can fix (a component that failed to build) is also the CLI's one error line.
    if isinstance(state.load_exception, LmstackError):
        raise state.load_exception
    return 1 if state.failed else 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LmstackError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
