"""Starting workers says what it is doing: ``LoopbackRouteProvider`` tells its ``notice`` when
its workers start and when they are ready, with the seconds it took."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from dgr_engine.tooling.loopback import LoopbackRouteProvider


def test_the_provider_says_when_its_workers_start_and_are_ready(tiny_llama: Path) -> None:
    said: list[str] = []

    async def start() -> None:
        provider = LoopbackRouteProvider(
            tiny_llama, [(0, 2), (2, 4)], spares=[(2, 4)], notice=said.append
        )
        async with provider:
            assert said[0] == f"starting 3 workers (2 stages and 1 spare) of {tiny_llama.name} ..."
            assert re.fullmatch(r"3 workers ready in \d+\.\d s", said[1]), said
            await provider.spawn((0, 2))
        assert said[2:3] == ["starting a replacement worker for layers [0,2) ..."], said
        assert re.fullmatch(r"replacement worker \[0,2\) ready in \d+\.\d s", said[3]), said

    asyncio.run(start())
    assert len(said) == 4, said
