"""A WAN between stages (issue 12): the userspace proxy (``dgr_engine.tooling.delay_proxy``)
and routes through it. Its delays are the thing under test, so the unit tests measure them; nothing
waits on a sleep for synchronisation. Routes over 30 ms RTT per hop keep the whole model's
tokens and recover from a killed stage within the policy's bounds."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.delay_proxy import Link, ProxiedRoutes, WanProxy
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionState,
)
from tests.harness import WORKER_OPTIONS, run

T = TypeVar("T")
OPTIONS = WORKER_OPTIONS
PROMPT = [9, 40, 2, 133, 77, 5, 18]
N_TOKENS = 12


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


def address_of(server: asyncio.Server) -> str:
    host, port = server.sockets[0].getsockname()[:2]
    return f"{host}:{port}"


async def round_trip(proxy: WanProxy, payload: bytes) -> tuple[float, bytes]:
    loop = asyncio.get_running_loop()
    host, port = proxy.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    began = loop.time()
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    took = loop.time() - began
    writer.close()
    return took, got


def test_delay_order_and_bandwidth_are_what_the_link_says() -> None:
    async def main() -> tuple[list[float], bytes, float, float]:
        server = await echo_server()
        try:
            async with await WanProxy.start(address_of(server), Link(rtt=0.06)) as slow:
                times = [(await round_trip(slow, b"x"))[0] for _ in range(3)]
            payload = bytes(range(256)) * 512  # 128 KiB, in many chunks
            link = Link(rtt=0.02, jitter=0.02, seed=7)
            async with await WanProxy.start(address_of(server), link) as jittery:
                _, echoed = await round_trip(jittery, payload)
            capped = Link(bandwidth=1_000_000)  # 1 MB/s each way: 128 KiB takes >= 0.13 s
            async with await WanProxy.start(address_of(server), capped) as thin:
                took, _ = await round_trip(thin, payload)
            async with await WanProxy.start(address_of(server), Link()) as fast:
                base, _ = await round_trip(fast, payload)
        finally:
            server.close()
        return times, echoed, took, base

    times, echoed, capped, base = run(main())
    # each way crosses the proxy once: client -> echo (30 ms) and back (30 ms)
    assert all(t >= 0.06 for t in times), times
    assert echoed == bytes(range(256)) * 512  # jitter never reorders bytes
    assert capped >= 131072 / 1_000_000 * 0.9 and capped > base  # both ways overlap


def test_drop_cuts_every_connection_and_refuse_keeps_them_out() -> None:
    async def main() -> tuple[int, bool, bool]:
        server = await echo_server()
        try:
            async with await WanProxy.start(address_of(server), Link()) as proxy:
                host, port = proxy.address.rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"ping")
                await reader.readexactly(4)
                dropped = proxy.drop()
                cut = await asyncio.wait_for(reader.read(), 5.0) == b""
                proxy.refuse = True
                reader2, _ = await asyncio.open_connection(host, int(port))
                refused = await asyncio.wait_for(reader2.read(), 5.0) == b""
        finally:
            server.close()
        return dropped, cut, refused

    dropped, cut, refused = run(main())
    assert dropped == 1 and cut and refused


@pytest.mark.slow
@pytest.mark.usefixtures("certified_fixtures")
def test_a_route_over_30ms_hops_is_exact_and_recovers_from_a_kill(tiny_llama: Path) -> None:
    ((want, _),) = whole_model_reference(tiny_llama, [PROMPT], N_TOKENS, OPTIONS)
    layout = ((0, 2), (2, 4))
    policy = FailurePolicy(step_deadline=3.0, backoff=(0.0,))

    async def main() -> tuple[list[Any], list[Any], str, list[float]]:
        pool = LoopbackRouteProvider(tiny_llama, layout, spares=[(2, 4)], options=OPTIONS)
        await pool.start()
        routes = ProxiedRoutes(pool, Link(rtt=0.03, jitter=0.002, seed=1))
        killed: list[str] = []
        stamps: list[float] = []
        handles: list[SessionHandle] = []
        loop = asyncio.get_running_loop()

        def on_token(_token: int) -> None:
            stamps.append(loop.time())
            if len(handles[1].tokens) == 5 and not killed:
                real = pool.worker(routes.real(handles[1].core.route.stages[1].endpoint))
                real.process.proc.send_signal(signal.SIGKILL)
                killed.append(real.endpoint)

        try:
            async with GrpcStageTransport(timeout=5.0, close_timeout=0.5) as transport:
                manager = SessionManager(
                    transport, routes, policy=policy, required_evidence=EvidenceClass.FIXTURE
                )
                handles.append(manager.start(PROMPT, max_new_tokens=N_TOKENS, session_id="calm"))
                handles.append(
                    manager.start(
                        PROMPT, max_new_tokens=N_TOKENS, session_id="hit", on_token=on_token
                    )
                )
                results = [await h.wait() for h in handles]
                await manager.aclose()
        finally:
            await routes.aclose()
            await pool.aclose()
        reported = [routes.real(r.endpoint or "") for r in results[1].reports]
        return results, reported, killed[0], stamps

    results, reported, killed, stamps = run(main(), limit=120.0)
    for result in results:
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == want
    hit = results[1]
    assert hit.route_changes == 1
    (report,) = hit.reports
    assert report.fault is FaultKind.DEAD and reported == [killed]  # behind its proxy
    gaps = np.diff(stamps)
    assert gaps.max() < policy.step_deadline + 2.0  # recovery within the bound, loosely
    assert gaps.min() >= 0.0
