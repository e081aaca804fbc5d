"""A worker's native links (``docs/native-path.md``): the control shell around the engine's own
link threads. It accepts connections on the native link port, checks each one's ``HELLO``
(the session's secret for that epoch, the epoch open here, a role this stage can take) and,
from ``Chain.Link``, dials the next stage's port itself; once a session epoch has every socket
its link needs, it starts the link (``ShardEngine.start_link``) and from then on runs no
Python per frame. It watches each link: once a second and at its end it records what the link
ran (usage, metrics), renews the session's use (its lease, the stall watchdog), and at its end
logs how it ended. A failed engine call closes the session as a non-finite output does on the
Python path (its KV may hold the rows).

A worker without TLS serves its links in the clear (a ``HELLO`` carries the session secret as
every Python-path frame does); a worker with TLS seals them (``wire/link_seal.py``): each
introduction proves the secret without sending it, and every message after it is sealed with
the keys it derived, in the link's own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs

from dgr_engine.engine import LinkKeys, LinkSockets, LinkState, LinkStats, NativeLink, ShardInfo
from dgr_engine.errors import FrameRejected, GrantUnauthenticated, ShardError
from dgr_engine.status import STATUSES, Status, is_worker_fault, status_of
from dgr_engine.wire import frames, link_seal
from dgr_engine.wire import link_messages as lm
from dgr_engine.wire.keepalive import keep_alive
from dgr_engine.worker.calls.introductions import IntroductionGate, Waiting
from dgr_engine.worker.lifecycle.closes import CloseCause, SessionClosed
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_engine.worker.reporting.load import LoadMeter
from dgr_engine.worker.reporting.metrics import WorkerMetrics
from dgr_engine.worker.reporting.usage import UsageBook
from dgr_session.errors import DgrError
from dgr_session.identifiers import log_field
from dgr_session.sampling import Sampling

if TYPE_CHECKING:
    from loguru import Logger

__all__ = ["NativeLinkHost", "NativeLinkServer", "WATCH_SECONDS"]

_KINDS = ("unspecified", "prefill", "decode", "replay")
"""The row kinds a native frame says (``ROWS``' value, ``ForwardRequest.kind``), by index."""
WATCH_SECONDS = 1.0
"""How often a running link's counters are read (usage, metrics, the session's use)."""
_DIAL_SECONDS = 10.0


class NativeLinkHost(Protocol):
    """What the native links need of their worker (``ShardWorker`` is one)."""

    @property
    def info(self) -> ShardInfo: ...

    @property
    def log(self) -> Logger: ...

    @property
    def table(self) -> SessionTable: ...

    @property
    def grants(self) -> GrantGate: ...

    @property
    def usage(self) -> UsageBook: ...

    @property
    def metrics(self) -> WorkerMetrics: ...

    @property
    def meter(self) -> LoadMeter: ...

    def start_link(
        self,
        key: int,
        epoch: int,
        hop: int,
        sockets: LinkSockets,
        notify_fd: int,
        sampling: Sampling,
    ) -> NativeLink:
        """Starts the engine's link of the session keyed ``key`` (its last stage takes the
        tokens with ``sampling``, the session's sampler)."""
        ...

    async def close_for(self, session_id: str, epoch: int, cause: CloseCause) -> None:
        """Closes ``(session_id, epoch)`` on the engine's thread."""
        ...


@attrs.define(eq=False)
class _Assembly:
    """One session epoch's link here: its sockets as they come, then the running link."""

    session_id: str
    epoch: int
    hop: int = -1
    inbound: socket.socket | None = None
    ring_in: socket.socket | None = None
    ring_in_hop: int = 0
    """The stage ``ring_in`` comes from, as its introduction said (the ring's last)."""
    outbound: socket.socket | None = None
    ring_out: socket.socket | None = None
    wants_ring_out: bool = False
    keys: dict[str, link_seal.ConnectionKeys] = attrs.Factory(dict)
    """A sealed link's keys, by the socket they belong to (``inbound``, ``ring_in``...)."""
    link: NativeLink | None = None
    watcher: asyncio.Task[None] | None = None
    counted: LinkStats | None = None
    notify: tuple[int, int] | None = None
    """The pipe the link writes a byte to when it ends (read end, write end)."""

    def sockets(self) -> list[socket.socket]:
        held = (self.inbound, self.ring_in, self.outbound, self.ring_out)
        return [s for s in held if s is not None]

    def link_keys(self) -> LinkKeys | None:
        """The link's keys (each socket's, in the direction the link uses it), once sealed."""
        if not self.keys:
            return None
        unused = bytes(link_seal.KEY_BYTES)
        ring_in, ring_out = self.keys.get("ring_in"), self.keys.get("ring_out")
        return LinkKeys(
            inbound=self.keys["inbound"].receive,
            outbound=self.keys["outbound"].send,
            ring_in=ring_in.receive if ring_in is not None else unused,
            ring_out=ring_out.send if ring_out is not None else unused,
        )


def _connection_lost(exc: BaseException) -> bool:
    """A connection that went away or fell silent (not a refusal: some refusals are
    ``PermissionError``, an ``OSError`` too)."""
    if isinstance(exc, DgrError):
        return False
    return isinstance(exc, (TimeoutError, OSError))


def _refusal(exc: Exception) -> tuple[int, str]:
    """A refusal's C status (``dgr_engine.status``: every status a worker sends has one, so the
    client reads it from the ``FAILED``'s number, never from its text) and its message."""
    if isinstance(exc, lm.LinkMessageError):
        exc = FrameRejected(f"DGR_E_FRAME: {exc}")
    code = STATUSES[status_of(exc)].c_code
    assert code is not None  # status_of answers only statuses a worker sends
    return code, str(exc)


class NativeLinkServer:
    """Serves one worker's native links (see the module's text)."""

    def __init__(
        self,
        host: NativeLinkHost,
        *,
        introductions: IntroductionGate,
        hello_seconds: float,
        counted: Callable[[str], None] = lambda what: None,
    ) -> None:
        """``introductions``: where connections wait for their ``HELLO`` (bounded per source
        and in all, ``worker/calls/introductions.py``), ``hello_seconds`` at most; ``counted``
        is told what came of each connection (``input``, ``ring``, ``output``, ``dialled``,
        ``refused`` or ``evicted``)."""
        self._host = host
        self.introductions = introductions
        self._hello = hello_seconds
        self._counted = counted
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._hellos: dict[asyncio.Task[None], Waiting] = {}
        self._links: dict[tuple[str, int], _Assembly] = {}
        self.port = 0
        self.refused = 0
        self.sealed = False
        """Seal every link (a worker with TLS; set before :meth:`start`): introductions that
        prove the session secret, sealed messages (``wire/link_seal.py``)."""

    @property
    def running(self) -> int:
        """Links running now."""
        return sum(1 for a in self._links.values() if a.link is not None and not a.link.closed)

    async def start(self, host: str, port: int) -> int:
        """Binds and accepts; returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=64)
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        return self.port

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, peer = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            keep_alive(sock)
            task = loop.create_task(self._introduce(sock))
            self._hellos[task] = self.introductions.admit(
                str(peer[0]), functools.partial(self._evict, task)
            )
            task.add_done_callback(self._left)

    def _evict(self, task: asyncio.Task[None]) -> None:
        """Ends a connection still waiting for its ``HELLO`` (the gate needs its place)."""
        self._counted("evicted")
        task.cancel()

    def _left(self, task: asyncio.Task[None]) -> None:
        place = self._hellos.pop(task, None)
        if place is not None:
            self.introductions.leave(place)

    def _refuse_now(self, sock: socket.socket, message: bytes) -> None:
        self.refused += 1
        self._counted("refused")
        with contextlib.suppress(OSError):
            sock.send(message)
        sock.close()

    async def _introduce(self, sock: socket.socket) -> None:
        """Reads and answers one connection's ``HELLO``; the socket joins its session's
        assembly, or is refused (a ``FAILED`` and closed)."""
        loop = asyncio.get_running_loop()
        hello: lm.Hello | None = None
        try:
            async with asyncio.timeout(self._hello):
                header, payload = await lm.read_socket_message(sock, lm.HELLO_MAX_BYTES)
            hello = lm.decode_hello(header, payload)
            answer, keys = self._check(hello)
            this = asyncio.current_task()
            if this is not None:
                self._left(this)  # introduced: no longer a stranger's place to evict
            assembly = self._assembly(hello.session_id, hello.epoch)
            self._place(assembly, hello, sock, keys)
            await loop.sock_sendall(sock, lm.encode_accept(hello.epoch, hello.hop, answer))
        except asyncio.CancelledError:  # evicted, or the server stops
            self._drop(sock, hello)
            raise
        except Exception as exc:  # noqa: BLE001 - any refusal is answered, never raised
            if _connection_lost(exc):
                self.refused += 1
                self._counted("refused")
                self._host.log.debug("native link connection dropped: {!r}", exc)
                self._drop(sock, hello)
                return
            status, text = _refusal(exc)
            self._host.log.bind(
                session=log_field(hello.session_id if hello else "-"),
                epoch=hello.epoch if hello else "-",
            ).warning("native link connection refused: {}", log_field(text, limit=1000))
            self._unplace(sock, hello)
            self._refuse_now(sock, lm.encode_failed(status, max(self._hop(hello), 0), text))
            return
        self._counted(hello.role.name.lower())
        self._maybe_start(assembly)

    def _hop(self, hello: lm.Hello | None) -> int:
        """This stage's index as the introduction names it (a ring's names its sender)."""
        return hello.hop if hello is not None and hello.role is not lm.Role.RING else 0

    def _drop(self, sock: socket.socket, hello: lm.Hello | None) -> None:
        """Forgets and closes a socket whose introduction failed."""
        self._unplace(sock, hello)
        sock.close()

    def _unplace(self, sock: socket.socket, hello: lm.Hello | None) -> None:
        """Forgets a socket an assembly took before its introduction failed."""
        assembly = self._links.get((hello.session_id, hello.epoch)) if hello else None
        if assembly is not None and assembly.link is None:
            for name in ("inbound", "ring_in", "outbound"):
                if getattr(assembly, name) is sock:
                    setattr(assembly, name, None)
                    assembly.keys.pop(name, None)

    def _check(self, hello: lm.Hello) -> tuple[bytes, link_seal.ConnectionKeys | None]:
        """Refuses an introduction this stage cannot take (the Python path's checks of a
        frame's session, secret and epoch, once for the connection); a sealed one's answer
        and keys (``wire/link_seal.py``)."""
        host = self._host
        frames.check_session_id(hello.session_id)
        answer, keys = b"", None
        if self.sealed:
            secret = host.grants.secret_of(hello.session_id, hello.epoch)
            if secret is None:  # not held here at that epoch: the table says how (stale...)
                host.table.check_open(hello.session_id, hello.epoch)
            answer, keys = link_seal.answer_hello(hello, secret)
        elif hello.sealed:
            raise GrantUnauthenticated(
                "DGR_E_UNAUTHENTICATED: this worker's native links are not sealed (it serves "
                "no TLS): introduce the connection with the session secret"
            )
        else:
            host.grants.check(hello.session_id, hello.epoch, hello.secret)
        host.table.check_open(hello.session_id, hello.epoch)
        if hello.role is lm.Role.OUTPUT and not host.info.is_last:
            raise FrameRejected("DGR_E_FRAME: only the last stage has an output stream")
        if hello.role is lm.Role.RING and not host.info.is_first:
            raise FrameRejected("DGR_E_FRAME: only the first stage takes a ring's frames")
        return answer, keys

    def _assembly(self, session_id: str, epoch: int) -> _Assembly:
        key = (session_id, epoch)
        assembly = self._links.get(key)
        if assembly is None:
            assembly = self._links[key] = _Assembly(session_id, epoch)
        return assembly

    def _place(
        self,
        assembly: _Assembly,
        hello: lm.Hello,
        sock: socket.socket,
        keys: link_seal.ConnectionKeys | None,
    ) -> None:
        taken = FrameRejected(
            f"DGR_E_FRAME: session {hello.session_id!r} epoch {hello.epoch} already has its "
            f"{hello.role.name.lower()} connection here"
        )
        if assembly.link is not None:
            raise taken
        if hello.role is lm.Role.INPUT:
            if assembly.inbound is not None:
                raise taken
            assembly.inbound, assembly.hop = sock, hello.hop
            name = "inbound"
        elif hello.role is lm.Role.RING:
            if assembly.ring_in is not None:
                raise taken
            assembly.ring_in, assembly.ring_in_hop = sock, hello.hop
            name = "ring_in"
        else:
            if assembly.outbound is not None:
                raise taken
            assembly.outbound, assembly.wants_ring_out = sock, hello.ring
            name = "outbound"
        if keys is not None:
            assembly.keys[name] = keys

    async def link_next(
        self,
        session_id: str,
        epoch: int,
        endpoint_host: str,
        port: int,
        secret: bytes,
        hop: int,
        *,
        ring: bool,
        sealed: bool = False,
    ) -> None:
        """From ``Chain.Link``: dials the next stage's native link (a ring's last stage: the
        first stage's), introduced with the next stage's secret and index (``sealed``: the
        next stage seals its links, so the introduction proves the secret and the answer must
        prove it back); raises the next stage's refusal as its typed error,
        ``ShardUnavailable``-like ``OSError`` when it cannot be reached."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in endpoint_host else socket.AF_INET)
        sock.setblocking(False)
        keep_alive(sock)
        try:
            async with asyncio.timeout(_DIAL_SECONDS):
                await loop.sock_connect(sock, (endpoint_host, port))
                role = lm.Role.RING if ring else lm.Role.INPUT
                dialer = link_seal.Dialer(role, session_id, epoch, secret, hop) if sealed else None
                hello = (
                    dialer.hello
                    if dialer is not None
                    else lm.Hello(role, session_id, epoch, bytes(secret), hop)
                )
                await loop.sock_sendall(sock, lm.encode_hello(hello))
                header, payload = await lm.read_socket_message(sock, lm.HELLO_MAX_BYTES)
            if header.kind is lm.Kind.FAILED:
                raise FrameRejected(
                    f"DGR_E_FRAME: the next stage refused the native link: {header.status}: "
                    f"{payload.decode(errors='replace')}"
                )
            if header.kind is not lm.Kind.HELLO:
                raise FrameRejected("DGR_E_FRAME: the next stage did not answer the HELLO")
            keys = dialer.keys(payload) if dialer is not None else None
            assembly = self._assembly(session_id, epoch)
            if assembly.link is not None or (ring and assembly.ring_out is not None):
                raise FrameRejected(
                    f"DGR_E_FRAME: session {session_id!r} epoch {epoch} is linked already"
                )
            if not ring and assembly.outbound is not None:
                raise FrameRejected(
                    f"DGR_E_FRAME: session {session_id!r} epoch {epoch} is linked already"
                )
        except BaseException:
            sock.close()
            raise
        name = "ring_out" if ring else "outbound"
        setattr(assembly, name, sock)
        if keys is not None:
            assembly.keys[name] = keys
        self._counted("dialled")
        self._maybe_start(assembly)

    def _maybe_start(self, assembly: _Assembly) -> None:
        """Starts the link once the assembly has what it needs: its input and its output
        (on the last stage, the client's output connection and, when that said the route is
        a ring, its link back to the first stage); the first stage's ring input, if any, came
        before its client's input (the client connects last)."""
        host = self._host
        if assembly.link is not None or assembly.inbound is None or assembly.outbound is None:
            return
        if host.info.is_last and assembly.wants_ring_out and assembly.ring_out is None:
            return
        log = host.log.bind(session=assembly.session_id, epoch=assembly.epoch)
        sockets = LinkSockets(
            assembly.inbound,
            assembly.outbound,
            assembly.ring_in,
            assembly.ring_out,
            ring_in_hop=assembly.ring_in_hop,
            keys=assembly.link_keys() if self.sealed else None,
        )
        notify = os.pipe()
        try:
            key = host.table.engine_key(assembly.session_id, assembly.epoch)
            sampling = host.table.sampling_of(assembly.session_id, assembly.epoch)
            assembly.link = host.start_link(
                key, assembly.epoch, assembly.hop, sockets, notify[1], sampling
            )
        except Exception as exc:  # noqa: BLE001 - the epoch closed meanwhile: nothing to run
            for fd in notify:
                os.close(fd)
            log.warning("native link not started: {}", log_field(str(exc), limit=1000))
            self._forget(assembly)
            return
        assembly.notify = notify
        assembly.counted = assembly.link.stats()
        assembly.watcher = asyncio.get_running_loop().create_task(self._watch(assembly))
        log.debug("native link started at hop {}", assembly.hop)

    async def _watch(self, assembly: _Assembly) -> None:
        """Counts a running link once a second and at its end (a byte on its pipe)."""
        link, notify = assembly.link, assembly.notify
        assert link is not None and notify is not None
        loop = asyncio.get_running_loop()
        read_end, write_end = notify
        ended: asyncio.Future[None] = loop.create_future()

        def woken() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(read_end, woken)
        try:
            while link.stats().state is LinkState.RUNNING:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WATCH_SECONDS):
                        await asyncio.shield(ended)
                self._account(assembly, link.stats())
            final = link.close()
            self._account(assembly, final)
            await self._ended(assembly, final)
        finally:
            loop.remove_reader(read_end)
            os.close(read_end)
            os.close(write_end)
            if self._links.get((assembly.session_id, assembly.epoch)) is assembly:
                del self._links[(assembly.session_id, assembly.epoch)]

    def _account(self, assembly: _Assembly, now: LinkStats) -> None:
        """What the link ran since last counted: usage, metrics, the session's use."""
        before = assembly.counted
        assert before is not None
        frames_run = now.frames - before.frames
        if frames_run <= 0:
            return
        host = self._host
        rows = now.rows - before.rows
        bytes_in, bytes_out = now.bytes_in - before.bytes_in, now.bytes_out - before.bytes_out
        engine_s = (now.engine_ns - before.engine_ns) / 1e9
        busy_s = (now.busy_ns - before.busy_ns) / 1e9
        # by row kind (the frames say theirs): the bytes and engine time shared by rows
        for index, kind in enumerate(_KINDS):
            ran = now.kind_frames[index] - before.kind_frames[index]
            kind_rows = now.kind_rows[index] - before.kind_rows[index]
            if ran <= 0:
                continue
            share = kind_rows / rows if rows else 0.0
            host.usage.forwarded(
                assembly.session_id,
                assembly.epoch,
                kind,
                kind_rows,
                round(bytes_in * share),
                round(bytes_out * share),
                engine_s * share,
                forwards=ran,
            )
        host.metrics.forwarded("native", rows, engine_s, busy_s, bytes_in, bytes_out)
        host.meter.admitted()
        host.meter.finished(rows)
        host.table.native_ran(assembly.session_id, assembly.epoch)
        assembly.counted = now

    async def _ended(self, assembly: _Assembly, final: LinkStats) -> None:
        log = self._host.log.bind(session=assembly.session_id, epoch=assembly.epoch)
        failure = final.failure()
        if final.throttled:
            log.info(
                "native link: {} of {} frames waited {:.2f} s in all for the session's frame "
                "budget (--frames-per-second)",
                final.throttled,
                final.frames,
                final.throttled_ns / 1e9,
            )
        if failure is None:
            log.debug("native link ended after {} frames: {}", final.frames, final.error)
            return
        mine = final.failed_hop == assembly.hop
        log.warning(
            "native link failed {}: {}",
            "here" if mine else f"at stage {final.failed_hop}",
            log_field(final.error, limit=1000),
        )
        if not mine:
            return
        if isinstance(failure, ShardError) and is_worker_fault(failure):
            self._host.meter.error()
        if final.status == Status.NON_FINITE:  # the engine's output was NaN or infinite
            await self._host.close_for(assembly.session_id, assembly.epoch, CloseCause.NON_FINITE)

    def session_closed(self, closed: SessionClosed) -> None:
        """A close listener: an epoch that closed here (or an older one) ends its link and
        drops the sockets it was still gathering."""
        for key, assembly in list(self._links.items()):
            if key[0] == closed.session_id and assembly.epoch <= closed.epoch:
                self._forget(assembly)

    def _forget(self, assembly: _Assembly) -> None:
        if assembly.link is not None:
            assembly.link.close()  # its watcher counts the end and drops the assembly
            return
        for sock in assembly.sockets():
            sock.close()
        self._links.pop((assembly.session_id, assembly.epoch), None)

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._hellos):
            task.cancel()
        for assembly in list(self._links.values()):
            self._forget(assembly)
        watchers = [a.watcher for a in self._links.values() if a.watcher is not None]
        if watchers:
            await asyncio.gather(*watchers, return_exceptions=True)
        self._links.clear()
        if self._listener is not None:
            self._listener.close()
