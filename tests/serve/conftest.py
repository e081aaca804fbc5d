"""A ``dgr serve`` app over a real route of in-process engines: the converter-made
``hf-llama-gqa`` fixture (a real tokenizer and chat template, 3 layers) split in two stages of
``ShardEngine``s behind ``EngineTransport``, one ``SessionManager``, the app served by uvicorn
on 127.0.0.1 from a thread of its own, for the official ``openai`` client to call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import pytest

from dgr_engine import ShardEngine
from dgr_engine.fixtures.converted import ensure_converted
from dgr_engine.options import EngineOptions
from dgr_engine.serve import ServedRoute, StageStatus, create_app, listen, serve, url_of
from dgr_engine.serve.keys import ApiKeys
from dgr_engine.testing import EngineTransport
from dgr_engine.tokenizer import Tokenizer
from dgr_session import EvidenceClass, FailurePolicy, SessionManager
from dgr_session.testing import FixedRouteProvider, fixture_identity, make_route

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=128, max_sessions=2)
"""The stages' engine options (and the whole model's, for parity)."""
LAYOUT = (("stage-a", (0, 2)), ("stage-b", (2, 3)))
"""The in-process route: two stages of the 3-layer model."""
STARTUP_LIMIT = 60.0
"""Seconds the server may take to start or stop."""


class EngineStages:
    """The route view's stages, read from the in-process engines (what a worker's advert says
    of its engine: range, sessions open, slots)."""

    def __init__(self, transport: EngineTransport) -> None:
        self.transport = transport

    async def stages(self) -> list[StageStatus]:
        engines = self.transport.engines()
        out = []
        for index, (endpoint, layers) in enumerate(LAYOUT):
            engine = engines.get(endpoint)
            if engine is None:
                out.append(StageStatus.unreachable(index, endpoint, layers, "killed"))
                continue
            out.append(
                StageStatus(
                    index=index,
                    endpoint=endpoint,
                    layers=layers,
                    serving=True,
                    backend="cpu",
                    certification="certified",
                    evidence="fixture",
                    sessions_open=engine.stats().open_sessions,
                    sessions_max=engine.info.max_sessions,
                    context_per_session=engine.info.n_ctx_per_session,
                )
            )
        return out


@attrs.define
class Served:
    """A running server and what the tests look at."""

    url: str
    model: Path
    transport: EngineTransport
    manager: SessionManager
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Runs ``coro`` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_sessions(self) -> dict[str, int]:
        """Sessions each stage's engine holds now (read on the server's loop)."""

        async def read() -> dict[str, int]:
            return {e: eng.stats().open_sessions for e, eng in self.transport.engines().items()}

        return dict(self.call(read()))

    def settled(self) -> dict[str, int]:
        """Open sessions once every session has ended and every close call has returned
        (sessions still running are cancelled: call it when none should be)."""

        async def read() -> dict[str, int]:
            # waits for every session to end and every close call in flight to return
            await self.manager.aclose(grace=10.0)
            return {e: eng.stats().open_sessions for e, eng in self.transport.engines().items()}

        return dict(self.call(read()))


@pytest.fixture(scope="session")
def converted_model() -> Path:
    return ensure_converted("hf-llama-gqa").gguf


def start_served(
    model: Path, policy: FailurePolicy | None = None, keys: ApiKeys | None = None
) -> Iterator[Served]:
    """Serves the in-process route until the generator is closed (its API taking only
    ``keys``, when given)."""
    ready: Future[Served] = Future()
    stop = threading.Event()
    done: Future[None] = Future()

    async def main() -> None:
        transport = EngineTransport(
            lambda a, b: ShardEngine(model, layers=(a, b), **OPTIONS.engine_kwargs())
        )
        for endpoint, layers in LAYOUT:
            transport.start(endpoint, layers)
        identity = fixture_identity(3)
        route = make_route([e for e, _ in LAYOUT], [2], identity=identity, width=64)
        manager = SessionManager(
            transport, FixedRouteProvider(route), required_evidence=EvidenceClass.FIXTURE
        )
        tokenizer = Tokenizer(model)
        served = ServedRoute(
            manager,
            tokenizer,
            model="hf-llama-gqa",
            context=OPTIONS.n_ctx_per_session,
            stages=EngineStages(transport),
            policy=policy,
        )
        sock = listen("127.0.0.1", 0)
        server = asyncio.ensure_future(serve(create_app(served, keys), sock))
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        threading.Thread(
            target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopped.set_result, None)),
            daemon=True,
        ).start()
        ready.set_result(Served(url_of(sock), model, transport, manager, loop))
        try:
            await stopped
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            await manager.aclose()
            transport.shutdown()
            tokenizer.close()
            sock.close()

    def thread() -> None:
        try:
            asyncio.run(main())
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - the test sees it
            if not ready.done():
                ready.set_exception(exc)
            done.set_exception(exc)

    threading.Thread(target=thread, name="dgr-serve-test", daemon=True).start()
    served = ready.result(STARTUP_LIMIT)
    try:
        yield served
    finally:
        stop.set()
        done.result(STARTUP_LIMIT)


@pytest.fixture(scope="module")
def served(converted_model: Path) -> Iterator[Served]:
    yield from start_served(converted_model)
