"""`FairSlots` (the Batch API worker's lines in flight): at most `width` at once, a freed slot to
the waiting tenant with the fewest in flight, cancelled waiters skipped or their grant passed on."""

from __future__ import annotations

import asyncio

from lmstack_api.batches.slots import FairSlots


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_the_tenant_with_fewest_in_flight():
    async def main() -> list[str]:
        slots = FairSlots(2)
        order: list[str] = []

        async def take(tenant: str) -> None:
            await slots.acquire(tenant)
            order.append(tenant)

        await take("a")
        await take("a")
        waiters = [asyncio.create_task(take(t)) for t in ("a", "a", "b")]
        await _settle()
        assert order == ["a", "a"] and slots.in_flight == 2  # full: all three wait
        slots.release("a")
        await _settle()
        assert order[-1] == "b", order  # b has none in flight; a has one
        slots.release("a")
        await _settle()
        slots.release("b")
        await _settle()
        await asyncio.gather(*waiters)
        assert slots.in_flight == 2 and slots.busy == {"a": 2}
        return order

    assert asyncio.run(main()) == ["a", "a", "b", "a", "a"]


def test_cancelled_waiters_do_not_keep_a_slot():
    async def main() -> None:
        slots = FairSlots(1)
        await slots.acquire("a")
        gone = asyncio.create_task(slots.acquire("b"))
        later = asyncio.create_task(slots.acquire("c"))
        await _settle()
        gone.cancel()
        await _settle()
        slots.release("a")
        await asyncio.wait_for(later, 1.0)
        assert slots.busy == {"c": 1}
        # Granted and cancelled in the same turn: the grant goes on to the next waiter.
        racing = asyncio.create_task(slots.acquire("d"))
        last = asyncio.create_task(slots.acquire("e"))
        await _settle()
        slots.release("c")  # grants d ...
        racing.cancel()  # ... whose task is cancelled before it resumes
        await asyncio.wait_for(last, 1.0)
        assert slots.busy == {"e": 1} and slots.in_flight == 1

    asyncio.run(main())
