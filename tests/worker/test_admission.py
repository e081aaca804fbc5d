"""The worker's admission line (``dgr_engine.worker.lifecycle.admission``): first come, first
served, a bounded wait, a typed busy answer with a retry hint. In-process, on one event loop."""

from __future__ import annotations

import asyncio

import pytest

from dgr_engine.errors import CapacityExceeded
from dgr_engine.wire.status import error_from_trailers, grpc_status_for, refusal_trailers
from dgr_engine.worker.lifecycle.admission import Admission
from dgr_session import FaultKind, StageBusy, fault_kind


class Slots:
    """Slots of a fake worker: an admitted open takes one, a close frees one."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.taken = 0

    def free(self) -> int:
        return self.total - self.taken


async def admit(admission: Admission, slots: Slots, name: str, order: list[str], wait: float):
    async with admission.turn(wait, name):
        slots.taken += 1
        order.append(name)


def test_a_free_slot_admits_at_once() -> None:
    async def main() -> list[str]:
        slots = Slots(2)
        admission = Admission(slots.free)
        order: list[str] = []
        await admit(admission, slots, "a", order, 0.0)
        await admit(admission, slots, "b", order, 0.0)
        return order

    assert asyncio.run(main()) == ["a", "b"]


def test_waiters_are_admitted_in_arrival_order_as_slots_free() -> None:
    async def main() -> tuple[list[str], int]:
        slots = Slots(1)
        admission = Admission(slots.free)
        order: list[str] = []
        await admit(admission, slots, "holder", order, 0.0)
        waiters = []
        for name in ("w1", "w2", "w3"):
            waiters.append(asyncio.create_task(admit(admission, slots, name, order, 5.0)))
            await asyncio.sleep(0)  # let it take its place in line
        seen_waiting = admission.waiting
        for _ in waiters:  # free one slot at a time; exactly the head of the line gets it
            slots.taken -= 1
            admission.changed()
            before = len(order)
            for _ in range(50):
                await asyncio.sleep(0)
                if len(order) > before:
                    break
        await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
        return order, seen_waiting

    order, seen_waiting = asyncio.run(main())
    assert seen_waiting == 3
    assert order == ["holder", "w1", "w2", "w3"]


def test_a_newcomer_never_passes_a_session_that_waited() -> None:
    async def main() -> list[str]:
        slots = Slots(1)
        admission = Admission(slots.free)
        order: list[str] = []
        await admit(admission, slots, "holder", order, 0.0)
        old = asyncio.create_task(admit(admission, slots, "old", order, 5.0))
        await asyncio.sleep(0)
        slots.taken -= 1  # a slot frees, and before the old waiter runs a newcomer arrives
        new = asyncio.create_task(admit(admission, slots, "new", order, 0.5))
        admission.changed()
        await asyncio.wait_for(old, 5.0)
        with pytest.raises(CapacityExceeded):
            await new  # the old one took the slot; the newcomer's short wait ran out
        return order

    assert asyncio.run(main()) == ["holder", "old"]


def test_a_wait_that_runs_out_is_busy_with_a_hint_and_leaves_the_line() -> None:
    async def main() -> tuple[CapacityExceeded, int]:
        slots = Slots(0)
        admission = Admission(slots.free)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(CapacityExceeded) as caught:
            await admit(admission, slots, "late", [], 0.2)
        assert loop.time() - began >= 0.2
        return caught.value, admission.waiting

    error, waiting = asyncio.run(main())
    assert waiting == 0
    assert error.retry_after is not None and error.retry_after > 0
    assert "no free session slot" in str(error)


def test_busy_is_load_not_a_fault_on_both_sides_of_the_wire() -> None:
    error = CapacityExceeded("DGR_E_CAPACITY: full")
    error.retry_after = 0.75
    assert isinstance(error, StageBusy)
    assert fault_kind(error) is FaultKind.BUSY
    code, status = grpc_status_for(error)
    trailers = refusal_trailers(error, status)
    back = error_from_trailers(code, trailers, "full")
    assert isinstance(back, CapacityExceeded)
    assert back.retry_after == 0.75
    assert fault_kind(back) is FaultKind.BUSY
