"""`FairSlots`: the batch lines in flight, shared fairly between the tenants whose batches run.

The batch worker runs one batch per tenant at a time, side by side; every line takes a slot
first. At most `width` lines are in flight over all of them, and a freed slot goes to the
waiting tenant with the fewest lines in flight (first come among equals): a tenant's 50,000-line
batch leaves another tenant's later batch an equal share from its first line on, instead of
holding the engine's batch capacity until it ends.
"""

from __future__ import annotations

import asyncio
from collections import Counter


class FairSlots:
    def __init__(self, width: int) -> None:
        self.width = width
        self.busy: Counter[str] = Counter()  # tenant -> lines in flight
        self._waiting: list[tuple[str, asyncio.Future[None]]] = []

    @property
    def in_flight(self) -> int:
        return self.busy.total()

    async def acquire(self, tenant: str) -> None:
        if self.in_flight < self.width and not self._waiting:
            self.busy[tenant] += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((tenant, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(tenant)  # granted just as its task was cancelled: hand it on
            else:
                self._waiting = [(t, f) for t, f in self._waiting if f is not fut]
            raise

    def release(self, tenant: str) -> None:
        self.busy[tenant] -= 1
        if self.busy[tenant] <= 0:
            del self.busy[tenant]
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.in_flight < self.width:
            i = min(range(len(self._waiting)), key=lambda j: (self.busy[self._waiting[j][0]], j))
            tenant, fut = self._waiting.pop(i)
            if fut.done():  # its waiter was cancelled
                continue
            self.busy[tenant] += 1
            fut.set_result(None)
