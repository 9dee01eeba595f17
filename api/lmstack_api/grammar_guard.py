"""Bounded grammar compilation for the API.

xgrammar compiles in C++ and cannot be interrupted: a schema with 5,000 optional properties
compiles for minutes and grows to gigabytes, and a thread running it can be neither cancelled
nor joined at shutdown. So every new schema is first compiled in a child process
(`lmstack_api.grammar_probe`) that is killed when it passes the time or memory bound, when its
request is cancelled (client gone) or when the server drains. Only a schema the child compiled
within the bounds is then compiled here, in a daemon thread (xgrammar's compiled grammars are
far too large to ship between processes), so the in-process compile is bounded by what was
just measured and no thread the interpreter waits for at exit ever runs it.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lmstack.errors import InvalidRequestError
from lmstack.sample.grammar import KIND_NOUNS, Grammar, GrammarCompiler, PreparedSchema
from lmstack_api.errors import APIError, overloaded
from lmstack_api.logs import get_logger

log = get_logger()
T = TypeVar("T")

SCHEMA_PARAM = "response_format.json_schema.schema"
_HEADER = struct.Struct(">I")
_POLL_S = 0.02  # how often the child's RSS is sampled while it compiles
_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in the child; not a compile


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return None


def _limit_error(message: str, param: str = SCHEMA_PARAM) -> APIError:
    return APIError(400, message, param=param, code="schema_too_complex")


class CompileGuard:
    """One reusable child process, one compile at a time (others wait their turn; only the
    compile itself counts against the time bound)."""

    def __init__(self, timeout_s: float, memory_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._baseline = 0  # the child's RSS once ready: compile growth is measured from it
        self._lock = asyncio.Lock()
        self._closed = False
        self._reaping: set[asyncio.Task] = set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def check(self, compiler: GrammarCompiler, prepared: PreparedSchema) -> int:
        """Compile `prepared` in the child; its grammar's size in bytes when it compiled within
        the bounds. APIError 400 naming the bound (or xgrammar's objection) otherwise."""
        async with self._lock:
            proc = await self._ensure(compiler)
            started = time.monotonic()
            try:
                self._send(proc, {"kind": prepared.kind, "text": prepared.text, "strict": prepared.strict})
                reply = await self._watch(proc, started, prepared)
            except BaseException:
                self._kill()  # mid-compile: the child is in an unknown state
                raise
        if reply.get("ok"):
            grown = reply.get("peak_rss", 0) - self._baseline
            if grown > self.memory_bytes:  # a spike between two RSS samples
                self._kill()  # its peak stays; a fresh child measures the next one fairly
                raise self._memory_error(grown, prepared)
            return int(reply.get("nbytes", 0))
        noun = KIND_NOUNS[prepared.kind]
        raise APIError(400, f"invalid {noun}: {reply.get('error')}", param=prepared.param)

    def close(self) -> None:
        """Kill the child (drain / shutdown): a compile in progress ends with 503 at once."""
        self._closed = True
        self._kill()

    async def aclose(self) -> None:
        """`close`, then reap every killed child while the event loop still runs."""
        self.close()
        await asyncio.gather(*self._reaping, return_exceptions=True)

    # --- the child ------------------------------------------------------------------------------

    async def _ensure(self, compiler: GrammarCompiler) -> asyncio.subprocess.Process:
        if self._closed:
            raise overloaded("the server is shutting down and admits no new requests", retry_after=5.0)
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "lmstack_api.grammar_probe",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self._proc = proc
        try:
            info = await asyncio.to_thread(compiler.tokenizer_info_json)
            self._send_raw(proc, info.encode())
            ready = await asyncio.wait_for(self._read(proc), _START_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        if ready is None:
            self._kill()
            if self._closed:
                raise overloaded("the server is shutting down and admits no new requests", retry_after=5.0)
            raise APIError(503, "the grammar compiler failed to start", type="server_error")
        self._baseline = max(ready.get("peak_rss", 0), _rss(proc.pid) or 0)
        log.info("grammar compile guard started", pid=proc.pid, rss_mib=self._baseline >> 20)
        return proc

    def _send(self, proc: asyncio.subprocess.Process, payload: dict) -> None:
        self._send_raw(proc, json.dumps(payload).encode())

    @staticmethod
    def _send_raw(proc: asyncio.subprocess.Process, data: bytes) -> None:
        assert proc.stdin is not None
        proc.stdin.write(_HEADER.pack(len(data)) + data)

    @staticmethod
    async def _read(proc: asyncio.subprocess.Process) -> dict | None:
        assert proc.stdout is not None
        try:
            head = await proc.stdout.readexactly(_HEADER.size)
            body = await proc.stdout.readexactly(_HEADER.unpack(head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return json.loads(body)

    async def _watch(
        self, proc: asyncio.subprocess.Process, started: float, prepared: PreparedSchema
    ) -> dict:
        noun, param = KIND_NOUNS[prepared.kind], prepared.param
        assert proc.stdin is not None
        await proc.stdin.drain()
        reader = asyncio.create_task(self._read(proc))
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=_POLL_S)
                if done:
                    reply = reader.result()
                    if reply is not None:
                        return reply
                    if self._closed:
                        raise overloaded(f"the server is shutting down; the {noun} was not compiled", 5.0)
                    raise _limit_error(
                        f"compiling the {noun} crashed the compiler process; simplify the {noun}", param
                    )
                elapsed = time.monotonic() - started
                if elapsed > self.timeout_s:
                    log.warning("grammar compile over time: killed", timeout_s=self.timeout_s)
                    raise _limit_error(
                        f"compiling the {noun} took longer than this server's limit of "
                        f"{self.timeout_s:g} s (server.grammar_compile_timeout_s); simplify the {noun}",
                        param,
                    )
                rss = _rss(proc.pid)
                if rss is not None and rss - self._baseline > self.memory_bytes:
                    log.warning("grammar compile over memory: killed", rss_mib=rss >> 20)
                    raise self._memory_error(rss - self._baseline, prepared)
        finally:
            reader.cancel()

    def _memory_error(self, grown: int, prepared: PreparedSchema) -> APIError:
        noun = KIND_NOUNS[prepared.kind]
        return _limit_error(
            f"compiling the {noun} needed more than this server's limit of "
            f"{self.memory_bytes >> 20} MiB (server.grammar_compile_memory_mib; it reached "
            f"{grown >> 20} MiB); simplify the {noun}",
            prepared.param,
        )

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            reap = asyncio.get_running_loop().create_task(proc.wait())
            self._reaping.add(reap)
            reap.add_done_callback(self._reaping.discard)


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread: unlike `asyncio.to_thread`, whose executor threads are
    joined when the loop closes, a compile still running at exit never holds the process."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # delivered to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=target, name="lmstack-grammar-compile", daemon=True).start()
    return await fut


async def bounded_grammar(
    compiler: GrammarCompiler, guard: CompileGuard, prepared: PreparedSchema
) -> Grammar:
    """The grammar for a prepared source: from the cache, or compiled within the guard's bounds."""
    cached = compiler.lookup(prepared)
    if cached is not None:
        return cached
    await guard.check(compiler, prepared)
    try:
        return await in_daemon_thread(compiler.compile, prepared)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param or prepared.param) from None


async def bounded_schema_grammar(
    compiler: GrammarCompiler,
    guard: CompileGuard,
    schema: Any,
    *,
    max_bytes: int,
    max_properties: int,
) -> Grammar:
    """The grammar for `schema`: from the cache, or compiled within the guard's bounds."""
    try:
        prepared = compiler.prepare(schema, max_bytes=max_bytes, max_properties=max_properties)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param or SCHEMA_PARAM) from None
    return await bounded_grammar(compiler, guard, prepared)
