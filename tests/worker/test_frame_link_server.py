"""A worker's frame link (``worker/calls/frame_link_server.py``) under bad input, the "Bad input"
part of issue 32: a peer that connects and never sends is dropped after the hello timeout
(``WorkerConfig.frame_link_hello_seconds``); bytes that are not the protocol (unknown kinds, a
``STATUS`` or ``HALF_CLOSE`` before ``OPEN``, lengths over the limit, junk requests) end the call
with ``INVALID_ARGUMENT`` / ``DGR_E_FRAME``; NaN rows, stale epochs and wrong secrets inside
well-formed frames get the gRPC path's typed refusals in the ``STATUS`` trailers; a peer that
writes faster than the engine runs is back-pressured by TCP (the link reads one frame at a
time); connections over ``max_connections`` get ``RESOURCE_EXHAUSTED`` / ``DGR_E_CAPACITY``.
Throughout, an honest session over the same link decodes the whole model's logits bit for bit
and no connection is left behind (``FrameLinkServer.open_calls``).

Workers are in-process ``ShardWorker``s on 127.0.0.1 over tiny-llama; every read is bounded
(``READ_SECONDS``, ``harness.run``'s limit), every wait is for an observable event under a
deadline, and every worker started is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire.frames import encode_forward
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.calls.frame_link_server import FrameLinkServer, connection_limit
from tests import harness
from tests.harness import LinkPeer, LinkSession, link_open

T = TypeVar("T")
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=16, max_sessions=4)
PROMPT = [7, 1, 200, 33, 90]
STEPS = 20
READ_SECONDS = harness.LINK_READ_SECONDS
GARBAGE = b"\xff\xff\xff\xff"  # a field tag whose varint never ends: no message parses it


def run(coro: Coroutine[Any, Any, T]) -> T:
    return harness.run(coro, 120.0)


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[np.ndarray]:
    """The whole model's logits rows, step by step (step 0: the prompt's last row)."""
    ((_, logits),) = whole_model_reference(tiny_llama, [PROMPT], STEPS, OPTIONS)
    return logits


@contextlib.asynccontextmanager
async def serving(
    model: Path, layers: tuple[int, int] = (0, 4), **config: Any
) -> AsyncIterator[ShardWorker]:
    """A started worker, stopped after; no error reached the event loop's handler meanwhile
    (a task's exception nobody awaited, a callback that raised: each a crash of its own)."""
    kw = OPTIONS.engine_kwargs()
    worker = ShardWorker.load(model, layers, **kw, config=WorkerConfig(**config))
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        await worker.start()
        yield worker
    finally:
        await worker.stop()
        loop.set_exception_handler(None)
    assert not unhandled, unhandled


def session(worker: ShardWorker, session_id: str, front: ShardEngine | None = None) -> LinkSession:
    """An honest session over ``worker``'s frame link (``harness.LinkSession``)."""
    return LinkSession(worker.address, worker.frame_link_port, session_id, PROMPT, front)


def link_of(worker: ShardWorker) -> FrameLinkServer:
    assert worker.frame_link is not None and worker.frame_link_port
    return worker.frame_link


async def until(what: Callable[[], bool], why: str, deadline: float = READ_SECONDS) -> None:
    """Waits for ``what()`` to hold, at most ``deadline`` seconds (it is state the loop
    changes: checked after each turn of the loop)."""
    async with asyncio.timeout(deadline):
        while not what():
            await asyncio.sleep(0.005)
    assert what(), why


# --- a peer that never sends --------------------------------------------------------------------

HELLO = 0.3
"""The hello timeout of these tests' workers (``WorkerConfig.frame_link_hello_seconds``)."""


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        fl.HEADER.pack(40, fl.Kind.OPEN)[:3],  # half a header
        fl.HEADER.pack(40, fl.Kind.OPEN) + b'{"method": ',  # an OPEN that never ends
        link_open("ChainOutput"),  # a call with no request
        link_open("ChainStream"),  # a stream with no frame
    ],
    ids=[
        "nothing",
        "half-a-header",
        "half-an-open",
        "output-without-request",
        "stream-without-frame",
    ],
)
def test_a_peer_that_stays_silent_is_dropped_after_the_hello_timeout(
    tiny_llama: Path, want: list[np.ndarray], sent: bytes
) -> None:
    async def scenario() -> None:
        async with serving(tiny_llama, frame_link_hello_seconds=HELLO) as worker:
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            await honest.step()
            loop = asyncio.get_running_loop()
            peer = await LinkPeer.connect(worker.frame_link_port)
            if sent:
                await peer.send(sent)
            began = loop.time()
            assert await peer.closed() == b""  # dropped without a word
            waited = loop.time() - began
            assert HELLO * 0.5 <= waited < READ_SECONDS, waited
            await until(lambda: link.open_calls == 2, "the silent connection is let go")
            await honest.step()  # the link served the honest session throughout
            await honest.close()
            await until(lambda: link.open_calls == 0, "every connection let go")
            assert honest.exact(want) and len(honest.logits) == 2

    run(scenario())


def test_the_hello_timeout_is_checked_and_defaults_to_ten_seconds() -> None:
    assert WorkerConfig().frame_link_hello_seconds == 3.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="frame_link_hello_seconds must be finite and > 0"):
            WorkerConfig(frame_link_hello_seconds=bad)


# --- bytes that are not the protocol ------------------------------------------------------------

STREAM = link_open("ChainStream")
OUTPUT = link_open("ChainOutput")
NOT_THE_PROTOCOL = {
    "unknown-kind": fl.HEADER.pack(0, 9),
    "status-before-open": fl.pack(fl.Kind.STATUS, fl.encode_status(fl.OK, "", ())),
    "half-close-before-open": fl.pack(fl.Kind.HALF_CLOSE),
    "message-before-open": fl.pack(fl.Kind.MESSAGE, b"\x08\x01"),
    "unknown-method": fl.pack(fl.Kind.OPEN, fl.encode_open("Forward", [])),
    "open-not-json": fl.pack(fl.Kind.OPEN, b"\xff{"),
    "open-over-its-limit": fl.HEADER.pack(fl.CONTROL_MAX_BYTES + 1, fl.Kind.OPEN),
    "length-over-the-limit": STREAM + fl.HEADER.pack(2**32 - 1, fl.Kind.MESSAGE),
    "unknown-kind-in-a-stream": STREAM + fl.HEADER.pack(3, 200) + b"abc",
    "open-in-a-stream": STREAM + STREAM,
    "status-in-a-stream": STREAM + fl.pack(fl.Kind.STATUS, b"{}"),
    "junk-frame": STREAM + fl.pack(fl.Kind.MESSAGE, GARBAGE),
    "half-close-for-a-request": OUTPUT + fl.pack(fl.Kind.HALF_CLOSE),
    "junk-output-request": OUTPUT + fl.pack(fl.Kind.MESSAGE, GARBAGE),
    "output-request-over-the-limit": OUTPUT + fl.HEADER.pack(2**31, fl.Kind.MESSAGE),
}


def test_bytes_that_are_not_the_protocol_end_the_call_typed(
    tiny_llama: Path, want: list[np.ndarray]
) -> None:
    """Each is answered ``INVALID_ARGUMENT`` with ``dgr-status: DGR_E_FRAME`` and the
    connection closed; the honest session decodes a token between any two."""

    async def scenario() -> None:
        async with serving(tiny_llama) as worker:
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            for name, data in NOT_THE_PROTOCOL.items():
                peer = await LinkPeer.connect(worker.frame_link_port)
                await peer.send(data)
                code, details, trailers = await peer.status()
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (name, details)
                assert trailers.get(STATUS_KEY) == "DGR_E_FRAME", (name, trailers)
                assert details.startswith("DGR_E_FRAME: "), (name, details)
                await honest.step()
            await until(lambda: link.open_calls == 2, "only the honest calls are open")
            assert link.refused >= 7  # the link's own refusals (the rest are the handler's)
            await honest.close()
            await until(lambda: link.open_calls == 0, "every connection let go")
        assert honest.exact(want) and len(honest.logits) == len(NOT_THE_PROTOCOL)

    run(scenario())


@pytest.mark.parametrize(
    "cut",
    [
        b"",  # a stream opened, then gone
        fl.HEADER.pack(100, fl.Kind.MESSAGE)[:2],  # gone mid-header
        fl.HEADER.pack(100, fl.Kind.MESSAGE) + bytes(10),  # a length that says more than sent
    ],
    ids=["after-open", "mid-header", "mid-message"],
)
def test_a_peer_gone_mid_message_leaves_nothing_behind(
    tiny_llama: Path, want: list[np.ndarray], cut: bytes
) -> None:
    """A connection closed mid-call: the worker lets it go (no answer: nobody to hear it), and
    the same peer's partial message left open holds only its own connection."""

    async def scenario() -> None:
        async with serving(tiny_llama) as worker:
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            await honest.step()
            peer = await LinkPeer.connect(worker.frame_link_port)
            await peer.send(STREAM + cut)
            await until(lambda: link.open_calls == 3, "the peer's call is open")
            await honest.step()  # a call stuck mid-message holds nobody else up
            peer.writer.transport.abort()  # gone at once, as a killed process goes
            await until(lambda: link.open_calls == 2, "the lost call is let go")
            await honest.step()
            await honest.close()
        assert honest.exact(want) and len(honest.logits) == 3

    run(scenario())


# --- well-formed frames the worker refuses --------------------------------------------------------


def test_nan_rows_stale_epochs_and_wrong_secrets_get_typed_refusals(
    tiny_llama: Path, want: list[np.ndarray]
) -> None:
    """On a later stage (layers [2, 4)), over the link: each refusal is the gRPC path's, its
    ``dgr-status`` in the ``STATUS`` trailers, none ``DGR_E_INTERNAL``; a session relayed
    through the same worker (its first layers run here) keeps the whole model's logits."""

    async def scenario() -> None:
        front = ShardEngine(tiny_llama, layers=(0, 2), **OPTIONS.engine_kwargs())
        try:
            async with serving(tiny_llama, (2, 4)) as worker:
                link = link_of(worker)
                honest = session(worker, "honest", front)
                await honest.open()
                await honest.step()
                async with ShardClient(worker.address, timeout=READ_SECONDS) as client:
                    expect = expectations_of(await client.describe())
                    await client.open("mallory", 1, expect)
                    secret = client.session_secret("mallory", 1)
                width = expect.boundary_width
                output = honest.target.ChainOutput(
                    pb.ChainOutputRequest(session_id="mallory", epoch=1, session_secret=secret)
                )
                async with asyncio.timeout(READ_SECONDS):
                    assert await output.read() == pb.ChainOutputReply()

                def frame(**change: Any) -> pb.ForwardRequest:
                    rows = change.pop("rows", np.ones((2, width), np.float32))
                    request = encode_forward(
                        "mallory", 1, 0, expect, [0, 1], boundary=rows, session_secret=secret
                    )
                    for key, value in change.items():
                        setattr(request, key, value)
                    return request

                nan = np.ones((2, width), np.float32)
                nan[1, 3] = np.nan
                inf = np.full((2, width), -np.inf, np.float32)
                invalid, unauthenticated = "INVALID_ARGUMENT", "UNAUTHENTICATED"
                cases = [
                    (
                        frame(rows=nan),
                        invalid,
                        "DGR_E_FRAME",
                        "non-finite values (1; first at row 1",
                    ),
                    (frame(rows=inf), invalid, "DGR_E_FRAME", "non-finite values (128;"),
                    (
                        frame(session_secret=bytes(16)),
                        unauthenticated,
                        "DGR_E_UNAUTHENTICATED",
                        "wrong",
                    ),
                    (frame(session_secret=b""), unauthenticated, "DGR_E_UNAUTHENTICATED", "wrong"),
                    (frame(epoch=7), "NOT_FOUND", "DGR_E_UNKNOWN_SESSION", "epoch 7 is not open"),
                ]
                for request, code, status, why in cases:
                    peer = await LinkPeer.connect(worker.frame_link_port)
                    await peer.send(STREAM + fl.pack(fl.Kind.MESSAGE, request.SerializeToString()))
                    got = await peer.status()
                    assert (got[0].name, got[2].get(STATUS_KEY)) == (code, status), got
                    assert why in got[1] and got[2].get("dgr-chain-hop") == "0", got
                    await honest.step()
                # an output stream asked with the wrong secret
                peer = await LinkPeer.connect(worker.frame_link_port)
                wrong = pb.ChainOutputRequest(session_id="mallory", epoch=1, session_secret=b"x")
                await peer.send(OUTPUT + fl.pack(fl.Kind.MESSAGE, wrong.SerializeToString()))
                got = await peer.status()
                assert (got[0].name, got[2].get(STATUS_KEY)) == (
                    unauthenticated,
                    "DGR_E_UNAUTHENTICATED",
                )
                # a newer epoch opened: the older one's frames are stale, the held epoch named
                async with ShardClient(worker.address, timeout=READ_SECONDS) as client:
                    await client.open("mallory", 2, expect)
                peer = await LinkPeer.connect(worker.frame_link_port)
                await peer.send(STREAM + fl.pack(fl.Kind.MESSAGE, frame().SerializeToString()))
                got = await peer.status()
                assert got[0] is grpc.StatusCode.FAILED_PRECONDITION, got
                assert got[2].get(STATUS_KEY) == "DGR_E_STALE_EPOCH", got
                assert got[2].get("dgr-held-epoch") == "2", got
                output.cancel()
                await honest.step()
                await honest.close()
                await until(lambda: link.open_calls == 0, "every connection let go")
        finally:
            front.close()
        assert honest.exact(want)

    run(scenario())


def test_a_worker_stops_with_calls_open_and_says_nothing_unhandled(tiny_llama: Path) -> None:
    """``stop`` cancels every open call (an honest session's streams mid-epoch, a silent peer):
    each connection is closed, and no cancelled handler reaches the loop as an error."""

    async def scenario() -> None:
        async with serving(tiny_llama) as worker:
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            await honest.step()
            peer = await LinkPeer.connect(worker.frame_link_port)
            await until(lambda: link.open_calls == 3, "three calls open")
        assert await peer.closed() == b""
        assert honest.output is not None and honest.stream is not None
        for call in (honest.output, honest.stream):  # lost, as a killed worker's calls are
            async with asyncio.timeout(READ_SECONDS):
                with pytest.raises(fl.LinkCallFailed) as lost:
                    await call.read()
            assert lost.value.code == fl.UNAVAILABLE, lost.value
        assert link.open_calls == 0

    run(scenario())


# --- a peer that writes faster than the engine runs ----------------------------------------------

FLOOD_CAP = 256 << 20
"""Bytes the flood may write at most: far more than the kernel's socket buffers hold (tens of
MiB at most), so a worker that read them all into memory would let every one through."""
STALL_SECONDS = 1.0
"""How long the flood waits for its socket to take more bytes before it counts itself pushed
back (the worker reads nothing more while its one frame waits for the engine)."""


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def push_until_pushed_back(sock: socket.socket, chunk: bytes) -> int:
    """Writes ``chunk`` again and again into a non-blocking ``sock``, as fast as the kernel
    takes it, until it takes nothing for ``STALL_SECONDS`` or ``FLOOD_CAP`` bytes went;
    returns the bytes that went."""
    loop = asyncio.get_running_loop()
    sent, view = 0, memoryview(chunk)
    at = 0
    while sent < FLOOD_CAP:
        try:
            n = sock.send(view[at:])
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock, _settle, writable)
            try:
                await asyncio.wait_for(writable, STALL_SECONDS)
            except TimeoutError:
                return sent
            finally:
                loop.remove_writer(sock)
            continue
        sent, at = sent + n, (at + n) % len(chunk)
    return sent


def test_a_peer_writing_faster_than_the_engine_runs_is_pushed_back(
    tiny_llama: Path, want: list[np.ndarray]
) -> None:
    """The engine held (a job on its thread waits for the test), a peer opens its session's
    stream and writes frames as fast as the kernel takes them: the link reads the first (it
    waits for the engine) and no more, so TCP pushes the peer back after a few MiB, however
    much it has to send; meanwhile the worker answers on its control plane, and once the
    engine runs again the honest session's frame, queued behind the flood's, is exact."""

    async def scenario() -> None:
        async with serving(tiny_llama) as worker:
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            await honest.step()
            flood = session(worker, "flood")  # its own session: its first frame runs
            await flood.open()
            assert flood.stream is not None and flood.output is not None
            flood.stream.cancel()
            size = min(60_000, worker.message_limits()[0] - 64)
            junk = fl.pack(fl.Kind.MESSAGE, bytes(size))  # refused once read: never read
            first = STREAM + fl.pack(fl.Kind.MESSAGE, flood.frame().SerializeToString())
            gate = threading.Event()
            held = asyncio.ensure_future(worker.dispatch.engine_thread.run(gate.wait, 60.0))
            sock = socket.create_connection(("127.0.0.1", worker.frame_link_port))
            try:
                sock.setblocking(False)
                sock.sendall(first)
                sent = await push_until_pushed_back(sock, junk * 16)
                print(f"\nflood: {sent / 2**20:.1f} MiB written before TCP pushed back")
                assert sent < FLOOD_CAP // 4, sent
                step = asyncio.ensure_future(honest.step())
                async with ShardClient(worker.address, timeout=READ_SECONDS) as client:
                    assert (await client.describe()).health.total_errors == 0
                assert not step.done()  # queued behind the held engine, as the flood is
            finally:
                gate.set()
                sock.close()
            async with asyncio.timeout(READ_SECONDS):
                await held
                await step
            flood.output.cancel()
            await until(lambda: link.open_calls == 2, "the flood's connections let go")
            await honest.step()
            await honest.close()
        assert honest.exact(want) and len(honest.logits) == 3

    run(scenario())


# --- more connections than the link serves --------------------------------------------------------


def test_connections_over_the_limit_get_resource_exhausted(
    tiny_llama: Path, want: list[np.ndarray]
) -> None:
    """With ``connection_limit(max_sessions)`` calls open (an honest session's two, the rest
    peers that opened a call and sent nothing since), each further call is answered
    ``RESOURCE_EXHAUSTED`` / ``DGR_E_CAPACITY`` and closed; the calls open go on, the worker
    serves its control plane, and once the peers leave a new session's calls are served. (A
    peer that says nothing at all holds no call: ``test_side_ports.py``.)"""
    limit = connection_limit(OPTIONS.max_sessions)

    async def opened() -> LinkPeer:
        peer = await LinkPeer.connect(worker_port[0])
        await peer.send(link_open("ChainStream"))
        return peer

    worker_port: list[int] = []

    async def scenario() -> None:
        async with serving(tiny_llama, frame_link_hello_seconds=60.0) as worker:
            worker_port.append(worker.frame_link_port)
            link = link_of(worker)
            honest = session(worker, "honest")
            await honest.open()
            await honest.step()
            silent = [await opened() for _ in range(limit - 2)]
            await until(lambda: link.open_calls == limit, "the link is full")
            for _ in range(3):
                extra = await opened()
                code, details, trailers = await extra.status()
                assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
                assert trailers == {STATUS_KEY: "DGR_E_CAPACITY"}, trailers
                assert f"{limit} frame link calls are open" in details
            assert (link.open_calls, link.refused) == (limit, 3)
            await honest.step()
            async with ShardClient(worker.address, timeout=READ_SECONDS) as client:
                await client.describe()
            for peer in silent:
                peer.close()
            await until(lambda: link.open_calls == 2, "the silent peers let go")
            second = session(worker, "second")
            await second.open()
            await second.step()
            await second.close()
            await honest.step()
            await honest.close()
        assert honest.exact(want) and len(honest.logits) == 3
        assert second.exact(want) and len(second.logits) == 1

    run(scenario())
