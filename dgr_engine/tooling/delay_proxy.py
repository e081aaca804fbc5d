"""A WAN between stages on one machine: a userspace TCP proxy adding latency, jitter, a
bandwidth cap and dropped connections (this machine's kernel has no netem).

:class:`WanProxy` listens on 127.0.0.1 and forwards every connection to one target. Each chunk
read in either direction is delivered ``rtt / 2`` (plus jitter) after it was read, in order
(jitter never reorders bytes: a chunk is never delivered before the one read before it), and no
faster than ``bandwidth`` bytes per second. :meth:`WanProxy.drop` cuts every connection, and
``refuse`` makes new ones fail, as a broken link would. A tool for tests and benchmarks; every
task it starts ends with :meth:`WanProxy.aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Coroutine
from typing import Any

import attrs

from dgr_session.faults import FailureReport
from dgr_session.route import Route
from dgr_session.transport import RouteProvider

_CHUNK = 64 * 1024


@attrs.frozen
class Link:
    """What the proxy does to the bytes."""

    rtt: float = 0.0
    """Round-trip time added, seconds (half each way)."""
    jitter: float = 0.0
    """Up to this many seconds added to a chunk's one-way delay (uniform, seeded)."""
    bandwidth: float | None = None
    """Bytes per second each way per connection; ``None``: unlimited."""
    seed: int = 0


class WanProxy:
    """``await WanProxy.start(target, link)``; ``address`` is what clients dial."""

    def __init__(self, target: str, link: Link) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.link = link
        self.refuse = False
        """New connections are closed at once while true."""
        self.connections = 0
        """Connections accepted so far."""
        self._rng = random.Random(link.seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    async def start(cls, target: str, link: Link) -> WanProxy:
        proxy = cls(target, link)
        proxy._server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        return proxy

    @property
    def address(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    def drop(self) -> int:
        """Cuts every open connection (both sides see it closed); returns how many."""
        writers = list(self._writers)
        for writer in writers:
            writer.transport.abort()
        return len(writers) // 2

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    async def __aenter__(self) -> WanProxy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), 10.0
            )
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        self._spawn(self._pipe(reader, up_writer, writer))
        self._spawn(self._pipe(up_reader, writer, up_writer))

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
    ) -> None:
        """Reads chunks and hands each to a sender that delivers them in order, late."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = loop.create_task(self._send(queue, writer))
        self._tasks.add(sender)
        sender.add_done_callback(self._tasks.discard)
        last_due = 0.0
        try:
            while data := await reader.read(_CHUNK):
                delay = self.link.rtt / 2 + self._rng.uniform(0, self.link.jitter)
                last_due = max(last_due, loop.time() + delay)  # never before the previous one
                queue.put_nowait((last_due, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(Exception):
                await sender
            for w in (writer, other):
                self._writers.discard(w)
                w.transport.abort()

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        rate = self.link.bandwidth
        free_at = 0.0  # when the capped link can take the next byte
        while (item := await queue.get()) is not None:
            due, data = item
            if rate:
                start = max(due, free_at)
                free_at = start + len(data) / rate
                due = free_at
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                return


class ProxiedRoutes:
    """A ``RouteProvider`` that puts a :class:`WanProxy` in front of every stage of the routes
    ``inner`` assigns (one proxy per endpoint, made on first use), and hands ``inner`` its
    failure reports with the real endpoints. ``await aclose()`` closes the proxies."""

    def __init__(self, inner: RouteProvider, link: Link) -> None:
        self.inner = inner
        self.link = link
        self.proxies: dict[str, WanProxy] = {}
        """By real endpoint."""
        self._real: dict[str, str] = {}

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None and report.endpoint in self._real:
            report = attrs.evolve(report, endpoint=self._real[report.endpoint])
        route = await self.inner.assign(session_id, report)
        if route is None:
            return None
        stages = []
        for stage in route.stages:
            proxy = self.proxies.get(stage.endpoint)
            if proxy is None:
                proxy = self.proxies[stage.endpoint] = await WanProxy.start(
                    stage.endpoint, self.link
                )
                self._real[proxy.address] = stage.endpoint
            stages.append(attrs.evolve(stage, endpoint=proxy.address))
        return Route(stages)

    def real(self, address: str) -> str:
        """The worker's endpoint behind a proxy address (itself if not a proxy's)."""
        return self._real.get(address, address)

    async def aclose(self) -> None:
        for proxy in self.proxies.values():
            await proxy.aclose()
