"""``PoolStages`` (``dgr_engine.serve.route_view``): the stages of the workers a server spawned,
as ``/health`` and ``/v1/route`` read them. A range no worker serves shows as down with a
replacement starting, one repair at a time, and after a repair failed the next waits
``REPAIR_BACKOFF`` (a load balancer probing every few seconds must not start a worker each
time). A fake pool stands for the provider; its one live worker's port is closed."""

from __future__ import annotations

import asyncio

import pytest

from dgr_engine.serve.route_view import REPAIR_BACKOFF, PoolStages, health
from tests.harness import closed_port


class FakePool:
    layout = ((0, 2), (2, 4))
    spawn_on_demand = True
    client_tls = None

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.repairs = 0
        self.release = asyncio.Event()
        self.endpoint = f"127.0.0.1:{closed_port()}"

    def live_endpoint(self, layers: tuple[int, int]) -> str | None:
        return self.endpoint if layers == (0, 2) else None

    async def repair(self) -> None:
        self.repairs += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the model is gone")


@pytest.mark.parametrize("fail", [False, True])
def test_a_range_without_a_worker_is_down_and_one_repair_runs_at_a_time(fail: bool) -> None:
    async def main() -> None:
        pool = FakePool(fail)
        stages = PoolStages(pool, timeout=2.0)
        first = await stages.stages()
        assert [s.serving for s in first] == [False, False]  # its port is closed: unreachable
        assert first[1].detail == "no worker serves layers [2,4): a replacement is starting"
        assert first[0].endpoint == pool.endpoint and first[1].index == 1
        why = health(first)
        assert why is not None and why.startswith("stage 0 (127.0.0.1:")
        await stages.stages()  # a second probe while the repair runs (it waits): no second one
        assert pool.repairs == 1
        pool.release.set()
        assert stages._repairing is not None
        await stages._repairing
        again = await stages.stages()
        if fail:  # within the back-off: down, and no replacement tried
            assert again[1].detail == "no worker serves layers [2,4)"
            assert stages._repairing.done() and pool.repairs == 1 and REPAIR_BACKOFF >= 10
        else:  # the range is still down: another repair is under way
            assert again[1].detail.endswith("a replacement is starting")
            await stages._repairing
            assert pool.repairs == 2

    asyncio.run(main())
