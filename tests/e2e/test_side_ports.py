"""Side ports that cannot be starved (issue 48): strangers on a worker's native link port and
frame link port (no key, no secret) beside an honest native ring of real ``dgr worker``
processes on 127.0.0.1.

Against each port of the ring's first stage (which takes the client's link and the ring's):
1,000 connections that say nothing, 1,000 that send half of a header and stall, 5,000 that
connect and close while the ring runs, all from one source address (127.0.0.2, as another host
would), and 1,000 that say nothing from four more (127.0.0.3 to 127.0.0.6). Each time the
honest ring gives the whole model's tokens, nobody is blamed or refused, it never waits out a
stranger's hello deadline, and once the strangers are gone the worker holds no more file
descriptors or threads than before. Its time against the same ring without strangers is
printed (``docs/reliability.md`` quotes it)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider, PooledWorker
from dgr_engine.worker.config import WorkerConfig
from dgr_session import EvidenceClass, FailurePolicy, SessionManager
from tests import harness

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPT = [3, 17, 29, 41, 5, 8]
N_TOKENS = 160
HELLO_SECONDS = WorkerConfig().frame_link_hello_seconds
ONE_SOURCE = "127.0.0.2"
SPREAD = ("127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6")
SETTLE_SECONDS = HELLO_SECONDS + 10.0


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[int]:
    ((tokens, _),) = whole_model_reference(tiny_llama, [PROMPT], N_TOKENS, OPTIONS)
    return tokens


def _dial(port: int, source: str, first: bytes) -> socket.socket | None:
    """A stranger's connection from ``source`` that sends ``first`` and then nothing; ``None``
    when the worker already let it go."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        if first:
            sock.sendall(first)
    except OSError:
        sock.close()
        return None
    return sock


class Strangers:
    """Connections to one port that never introduce themselves."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._churn: threading.Thread | None = None
        self.churned = 0
        self.expected = 0

    def idle(self, n: int, sources: tuple[str, ...], first: bytes = b"") -> None:
        for k in range(n):
            sock = _dial(self.port, sources[k % len(sources)], first)
            if sock is not None:
                self.held.append(sock)

    def churn(self, n: int, source: str) -> None:
        """Connects and closes ``n`` times, in a thread, while the caller goes on (once the
        first tenth are made); :meth:`close` waits for the rest."""
        started = threading.Event()

        def run() -> None:
            for k in range(n):
                if self._stop.is_set():
                    return
                sock = _dial(self.port, source, b"")
                if sock is not None:
                    sock.close()
                self.churned += 1
                if k == n // 10:
                    started.set()
            started.set()

        self.expected = n
        self._churn = threading.Thread(target=run, daemon=True)
        self._churn.start()
        assert started.wait(60.0)

    def close(self) -> None:
        if self._churn is not None:
            self._churn.join(120.0)
            self._stop.set()
            assert not self._churn.is_alive() and self.churned == self.expected
        for sock in self.held:
            sock.close()
        self.held.clear()


ATTACKS: dict[str, Callable[[Strangers], None]] = {
    "1000-idle": lambda s: s.idle(1000, (ONE_SOURCE,)),
    "1000-stalled-header": lambda s: s.idle(1000, (ONE_SOURCE,), first=b"\x00\x00"),
    "5000-connect-and-close": lambda s: s.churn(5000, ONE_SOURCE),
    "1000-idle-from-4-sources": lambda s: s.idle(1000, SPREAD),
}


def held_by(worker: PooledWorker) -> tuple[int, int]:
    """The worker's file descriptors and threads (but gRPC's event engine pool, which grows
    with load and shrinks when idle by itself)."""
    tasks = Path(f"/proc/{worker.pid}/task")
    threads = [t for t in tasks.iterdir() if (t / "comm").read_text().strip() != "event_engine"]
    return len(os.listdir(f"/proc/{worker.pid}/fd")), len(threads)


@pytest.fixture(scope="module")
def ring(tiny_llama: Path) -> Iterator[LoopbackRouteProvider]:
    provider = LoopbackRouteProvider(tiny_llama, ((0, 2), (2, 4)), options=OPTIONS)
    harness.run(provider.start(), 120.0)
    try:
        yield provider
    finally:
        harness.run(provider.aclose(), 60.0)


async def _honest(provider: LoopbackRouteProvider, session_id: str) -> tuple[list[int], float]:
    began = time.perf_counter()
    async with ChainStageTransport(
        timeout=10.0, close_timeout=2.0, ring=True, data_path="native"
    ) as transport:
        manager = SessionManager(
            transport,
            provider,
            policy=FailurePolicy(step_deadline=10.0),
            required_evidence=EvidenceClass.FIXTURE,
        )
        handle = manager.start(PROMPT, max_new_tokens=N_TOKENS, session_id=session_id)
        result = await handle.wait()
        await manager.aclose()
        assert result.error is None, result.error
        assert transport.chain_stats.native_epochs == result.epoch == 1
    return list(result.tokens), time.perf_counter() - began


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("port_kind", ["native", "frame"])
def test_strangers_on_a_side_port_neither_starve_nor_slow_an_honest_ring(
    port_kind: str, attack: str, ring: LoopbackRouteProvider, want: list[int]
) -> None:
    first = ring.workers[0]
    paths = first.advert.data_paths
    port = paths.native_link_port if port_kind == "native" else paths.frame_link_port
    tokens, usual = harness.run(_honest(ring, f"usual-{port_kind}-{attack}"), 120.0)
    assert tokens == want
    before = held_by(first)
    strangers = Strangers(port)
    try:
        ATTACKS[attack](strangers)
        tokens, flooded = harness.run(_honest(ring, f"beside-{port_kind}-{attack}"), 120.0)
    finally:
        strangers.close()
    assert tokens == want
    assert ring.reports == [], ring.reports  # nobody refused, blamed or busy
    assert flooded < usual + HELLO_SECONDS, (usual, flooded)  # it never waited out a stranger
    print(f"\n{port_kind} port, {attack}: {flooded / usual:.2f} x the ring's usual time")

    deadline = time.monotonic() + SETTLE_SECONDS
    while held_by(first)[0] > before[0] or held_by(first)[1] > before[1]:
        assert time.monotonic() < deadline, (before, held_by(first))
        harness.run(asyncio.sleep(0.2), 5.0)  # a remote count: nothing to wait on
