"""The server's batch worker: runs each tenant's batches one at a time, oldest first, and the
tenants' side by side, each line through the HTTP handlers (`dispatch`) at batch priority with
at most `server.batch_max_inflight` lines in flight over all batches, so the engine's queue never
holds more batch work than one scheduler step can take; the slots are shared fairly between the
tenants (`slots.FairSlots`).

Every state change is in the store first, so the worker may die anywhere: on restart it picks up
each unfinished batch where its committed lines left it (`validating` checks the file again,
`in_progress` runs the lines with no row yet, `finalizing` / `cancelling` write the files again).
A line is recorded only with an answer about the line itself; "not now" answers (429, 503, the
line stopped by a cancel or a drain) leave it to run again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

from lmstack_api.batches.dispatch import RETRY_STATUSES, Reply, invalid_record, record_of, run_line
from lmstack_api.batches.lines import Line, error_record, read_lines
from lmstack_api.batches.slots import FairSlots
from lmstack_api.batches.store import BatchStore
from lmstack_api.logs import get_logger
from lmstack_api.state import ServerState

log = get_logger()

POLL_S = 0.5  # how often a running batch looks for a cancel, a drain or its deadline


def key_hash(key: str | None) -> str | None:
    return hashlib.sha256(key.encode()).hexdigest() if key is not None else None


class BatchRunner:
    def __init__(self, store: BatchStore, state: ServerState) -> None:
        self.store = store
        self.state = state
        self.app: Any = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._running: dict[str, tuple[str, asyncio.Task]] = {}  # batch id -> (tenant, its task)
        self._stops: dict[str, asyncio.Event] = {}  # batch id -> its lines' stop, while they run
        self._slots: FairSlots | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, app: Any) -> None:
        self.app = app
        self._task = asyncio.create_task(self._main())

    async def stop(self) -> None:
        """Stop between lines: running ones are aborted (they run again after a restart)."""
        self._stopping = True
        self._wake.set()
        for stop in self._stops.values():
            stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self, batch_id: str | None = None) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self._wake.set()
        if batch_id in self._stops:
            self._stops[batch_id].set()

    @property
    def _paused(self) -> bool:
        return self._stopping or self.state.draining or self.state.failed

    async def _main(self) -> None:
        try:
            while not self._stopping and not self.state.failed:
                if self.state.engine is None or self.state.draining:
                    await asyncio.sleep(POLL_S)
                    continue
                self._wake.clear()  # before looking: a wake from here on is seen below
                busy = {tenant for tenant, _ in self._running.values()}
                for batch_id, tenant in await self.store.run(self.store.active_batches):
                    if tenant not in busy:  # the tenant's oldest (a running one's tenant is busy)
                        busy.add(tenant)
                        self._running[batch_id] = (
                            tenant,
                            asyncio.create_task(self._guarded(batch_id, tenant)),
                        )
                woken = asyncio.create_task(self._wake.wait())
                tasks = [task for _, task in self._running.values()]
                await asyncio.wait([woken, *tasks], timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                for batch_id in [b for b, (_, task) in self._running.items() if task.done()]:
                    del self._running[batch_id]
        finally:
            await asyncio.gather(*(task for _, task in self._running.values()), return_exceptions=True)

    async def _guarded(self, batch_id: str, tenant: str) -> None:
        try:
            await self._run(batch_id, tenant)
        except Exception as exc:  # a bug must not wedge every later batch behind this one
            log.error("batch failed", batch_id=batch_id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            await self._fail(batch_id, "internal_error", "the server could not run this batch")

    # --- one batch ----------------------------------------------------------------------------

    async def _run(self, batch_id: str, tenant: str) -> None:
        store = self.store
        batch = await store.run(store.get_batch, None, batch_id)
        assert batch is not None
        status = batch["status"]
        if status == "cancelling":
            await store.run(store.finalize, batch_id, "cancelled")
            return
        if status == "finalizing":
            await store.run(store.finalize, batch_id, "completed")
            return
        lines = await self._read(batch)
        if lines is None:
            return
        if status == "validating":
            # Lines that cannot run are finished now; a repeat after a crash changes nothing.
            bad = [(ln.number, *invalid_record(ln)) for ln in lines if ln.error is not None]
            if bad:
                await store.run(store.record, batch_id, bad)
            ok = await store.run(
                store.set_status, batch_id, "in_progress", when=("validating",), total=len(lines)
            )
            if not ok:  # cancelled meanwhile: the next pass finalizes it
                return
            log.info("batch started", batch_id=batch_id, lines=len(lines), invalid=len(bad))
        headers = self._identity(batch)
        if headers is None:
            await self._fail(
                batch_id, "api_key_removed", "the API key that created this batch is not configured"
            )
            return
        done = await store.run(store.done_lines, batch_id)
        todo = [ln for ln in lines if ln.error is None and ln.number not in done]
        stop, expired = asyncio.Event(), asyncio.Event()
        if time.time() >= batch["expires_at"]:  # e.g. resumed after a long outage: run nothing
            expired.set()
            todo = []
        self._stops[batch_id] = stop
        if self._stopping:
            stop.set()
        watch = asyncio.create_task(self._watch(batch, stop, expired))
        try:
            await self._run_lines(batch_id, tenant, todo, headers, stop)
        finally:
            watch.cancel()
            del self._stops[batch_id]
        await self._settle(batch_id, lines, expired.is_set())

    async def _read(self, batch: dict[str, Any]) -> list[Line] | None:
        path = self.store.file_path(batch["input_file_id"])
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError:
            await self._fail(batch["id"], "input_file_missing", "the batch's input file is gone")
            return None
        return await asyncio.to_thread(read_lines, data, batch["endpoint"])

    def _identity(self, batch: dict[str, Any]) -> dict[str, str] | None:
        """Headers that make each line the batch owner's request: its key (rate limits and
        per-key settings apply to batch work too), or its X-Tenant on a server without keys.
        None when the key is no longer configured (nor any other of the tenant's)."""
        state = self.state
        if not state.api_keys:
            return {"x-tenant": batch["tenant"]} if batch["tenant"] else {}
        keys = [k for k, _ in state.api_keys if key_hash(k.decode()) == batch["key_hash"]]
        keys = keys or [k for k, tenant in state.api_keys if tenant == batch["tenant"]]
        return {"authorization": f"Bearer {keys[0].decode()}"} if keys else None

    async def _watch(self, batch: dict[str, Any], stop: asyncio.Event, expired: asyncio.Event) -> None:
        """Stop the batch's lines on a cancel, a drain, the runner stopping or the deadline."""
        while not stop.is_set():
            await asyncio.sleep(POLL_S)
            status = await self.store.run(self.store.status, batch["id"])
            if time.time() >= batch["expires_at"]:
                expired.set()
            if self._paused or expired.is_set() or status != "in_progress":
                stop.set()

    async def _run_lines(
        self, batch_id: str, tenant: str, todo: list[Line], headers: dict[str, str], stop: asyncio.Event
    ) -> None:
        cfg, engine = self.state.config, self.state.engine
        width = cfg.batch_max_inflight or (engine.limits.max_num_seqs if engine is not None else 8)
        if self._slots is None:  # one for every batch: the width is the server's, fixed
            self._slots = FairSlots(width)
        slots = self._slots
        queue = iter(todo)

        async def run(line: Line) -> None:
            while not stop.is_set():
                reply: Reply = await run_line(self.app, line, headers, stop)
                if reply.status in RETRY_STATUSES or (reply.status >= 500 and self._paused):
                    if not stop.is_set():
                        await _sleep_or(stop, reply.retry_after())
                    continue
                await self.store.run(self.store.record, batch_id, [(line.number, *record_of(line, reply))])
                return

        async def worker() -> None:
            for line in queue:  # shared: each line goes to one worker
                await slots.acquire(tenant)
                try:
                    await run(line)
                finally:
                    slots.release(tenant)
                if stop.is_set():
                    return

        async with asyncio.TaskGroup() as group:  # one failing cancels the others
            for _ in range(max(1, min(width, len(todo)))):
                group.create_task(worker())

    async def _settle(self, batch_id: str, lines: list[Line], expired: bool) -> None:
        """After the lines ran or stopped: finalize the batch if it is over, else leave it."""
        store = self.store
        batch = await store.run(store.get_batch, None, batch_id)
        assert batch is not None
        if batch["status"] == "cancelling":
            await store.run(store.finalize, batch_id, "cancelled")
            log.info("batch cancelled", batch_id=batch_id)
            return
        done = await store.run(store.done_lines, batch_id)
        left = [ln for ln in lines if ln.number not in done]
        if left and expired:
            rows = [
                (ln.number, False, error_record(ln.custom_id, "batch_expired", "the batch's window ran out"))
                for ln in left
            ]
            await store.run(store.record, batch_id, rows)
            await store.run(store.finalize, batch_id, "expired")
            log.info("batch expired", batch_id=batch_id, unfinished=len(left))
            return
        if left:  # stopped by a drain or shutdown: resumed later
            return
        if await store.run(store.set_status, batch_id, "finalizing", when=("in_progress",)):
            await store.run(store.finalize, batch_id, "completed")
            log.info("batch completed", batch_id=batch_id, lines=len(lines))

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = json.dumps(
            {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        )
        await self.store.run(
            self.store.set_status,
            batch_id,
            "failed",
            when=("validating", "in_progress", "finalizing", "cancelling"),
            errors=errors,
        )


async def _sleep_or(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass
