"""Per-client limits (issue 16, part 3): one client identity cannot hold more than its sessions
of a worker, one session cannot send more than its frames per second; both are typed
``DGR_E_CAPACITY`` refusals that change nothing else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import CapacityExceeded, GrantDenied
from dgr_engine.reference import InProcessRoute
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.lifecycle.closes import CloseCause, SessionClosed
from dgr_engine.worker.lifecycle.peer_limits import PeerLimitConfig, PeerLimits, client_identity

KW = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}
PROMPT = [7, 70, 170, 17]


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_client_identity_is_the_certificate_name_else_the_host() -> None:
    assert client_identity("ipv4:10.1.2.3:5555", {}) == "addr:10.1.2.3"
    assert client_identity("ipv6:[::1]:5555", {}) == "addr:::1"
    assert client_identity("ipv4:10.1.2.3:5555", {"x509_common_name": [b"alice"]}) == "cert:alice"
    assert client_identity("unix:/tmp/s", {}) == "addr:unix:/tmp/s"


def test_sessions_per_client_counts_only_sessions_still_held() -> None:
    limits = PeerLimits(PeerLimitConfig(sessions_per_client=2))
    for sid in ("a", "b"):
        limits.check_open("x", sid)
        limits.opened("x", sid)
    limits.check_open("x", "a")  # a newer epoch of a session it holds
    limits.check_open("y", "c")  # another client
    with pytest.raises(CapacityExceeded, match="client x holds 2 sessions, its limit"):
        limits.check_open("x", "c")
    limits.session_closed(SessionClosed("a", 1, CloseCause.LEASE))  # by anyone: the lease
    limits.check_open("x", "c")
    with pytest.raises(ValueError, match="sessions_per_client must be >= 1"):
        PeerLimitConfig(sessions_per_client=0)


def test_a_held_session_is_its_clients_until_it_is_closed() -> None:
    """Without grants, another identity's open of a held session would discard its state:
    refused; its own client may open it again, and anyone once nobody holds it."""
    limits = PeerLimits(PeerLimitConfig())
    limits.opened("cert:alice", "s")
    with pytest.raises(GrantDenied, match="another client holds it"):
        limits.check_owner("cert:bob", "s")
    limits.check_owner("cert:alice", "s")  # a newer epoch of its own session
    limits.check_owner("cert:bob", "t")  # a session nobody holds
    limits.session_closed(SessionClosed("s", 0, CloseCause.STALL))  # a lease, a stall, ...
    limits.check_owner("cert:bob", "s")


def test_frames_per_second_is_a_bucket_with_a_retry_hint() -> None:
    clock = Clock()
    limits = PeerLimits(PeerLimitConfig(frames_per_second=2.0, burst=3), clock)
    for _ in range(3):
        limits.check_frame("s")
    with pytest.raises(CapacityExceeded, match="more than 2 frames per second") as caught:
        limits.check_frame("s")
    assert caught.value.retry_after == pytest.approx(0.5)
    limits.check_frame("other")  # each session has its own bucket
    clock.now += 0.5
    limits.check_frame("s")
    with pytest.raises(CapacityExceeded):
        limits.check_frame("s")


def test_a_worker_enforces_both_limits_and_serves_on(tiny_llama: Path) -> None:
    with ShardEngine(tiny_llama, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        want = chain.forward(1, 0, PROMPT, 0)[-1]
    config = WorkerConfig(sessions_per_client=1, frames_per_second=0.01)
    worker = ShardWorker.load(tiny_llama, (0, 4), config=config, **KW)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("s1", 1, expect)
                with pytest.raises(CapacityExceeded, match="client addr:127.0.0.1 holds 1"):
                    await client.open("s2", 1, expect)
                assert worker.table.snapshot().sessions_open == 1
                await client.close("s1", 1)
                await client.open("s2", 1, expect)
                positions = list(range(len(PROMPT)))
                got = await client.forward("s2", 1, 0, expect, positions, tokens=PROMPT)
                assert np.array_equal(np.asarray(got.output)[-1], want)
                for step in range(1, 8):  # the rest of the burst of 8
                    position = [len(PROMPT) + step - 1]
                    await client.forward("s2", 1, step, expect, position, tokens=[5])
                with pytest.raises(CapacityExceeded, match="more than 0.01 frames per second"):
                    await client.forward("s2", 1, 8, expect, [len(PROMPT) + 7], tokens=[5])
                assert worker.meter.snapshot().total_errors == 0  # the client's doing
        finally:
            await worker.stop()

    asyncio.run(scenario())
