"""The frame link under hostile input (issue 32, "Bad input"): the wire fuzzers of
``test_wire_fuzz.py`` sent to a ``dgr worker`` process's frame link port.

Hypothesis sends raw bytes (after an ``OPEN``, or none); headers of any kind and length (lengths
over the limit, lengths that say more than is sent, unknown kinds, a ``STATUS`` or
``HALF_CLOSE`` before ``OPEN``); generated ``ForwardRequest`` frames on a ``ChainStream`` and junk
``ChainOutput`` requests; frames cut anywhere (the connection half-closed mid-message); and, on
a later stage, frames of an open session with any boundary tensor (NaN and infinite rows among
them), any secret and any epoch (stale ones among them). Each connection ends with the write
side half-closed and is read until the worker closes it, every read bounded. Every answer is a
well-formed ``STATUS`` (or none: the call dropped), never ``UNKNOWN``, and a refusal carries a
``dgr-status`` that is never ``DGR_E_INTERNAL``. Between any two examples a victim session
decodes one token over the same link, its logits the whole model's bit for bit; after each
fuzzer the process is alive, its advert's ``total_errors`` is 0, its log has no traceback,
and the link takes exactly ``connection_limit(max_sessions)`` calls (none was leaked).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr_engine import ShardEngine
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire.frames import encode_forward
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker.calls.frame_link_server import connection_limit
from tests.e2e.test_wire_fuzz import (
    ARGS,
    FUZZ,
    INT32,
    OPTIONS,
    PROMPT,
    assert_healthy,
    forward_requests,
    session_ids,
)
from tests.harness import LINK_READ_SECONDS, LinkPeer, LinkSession, LinkStatus, link_open

pytestmark = pytest.mark.slow

T = TypeVar("T")
EXAMPLES = 40
"""Per fuzzer (the link's six add well under a minute)."""
LINK_FUZZ = settings(FUZZ, max_examples=EXAMPLES)
MAX_SESSIONS = 64  # ARGS's --max-sessions
LINK_ARGS = [*ARGS, "--hello-seconds", "60"]
"""The fuzzers' workers: a call opened and silent is held 60 s, not 3, so that the check for
leaked calls (hundreds of them, opened one by one) never sees the first ones dropped."""
METHODS = ("", "ChainStream", "ChainOutput")
"""What a connection opens first ("": no ``OPEN``)."""


class Loop:
    """One event loop for a whole test: the victim's link calls live across the examples."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()

    def __call__(self, coro: Coroutine[Any, Any, T], limit: float = 30.0) -> T:
        return self._loop.run_until_complete(asyncio.wait_for(coro, limit))

    def close(self) -> None:
        self._loop.close()


@pytest.fixture()
def loop() -> Iterator[Loop]:
    running = Loop()
    yield running
    running.close()


@pytest.fixture(scope="module")
def worker(tiny_llama: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess.spawn(tiny_llama, (0, 4), extra_args=LINK_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def last_stage(tiny_llama: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess.spawn(tiny_llama, (2, 4), extra_args=LINK_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[np.ndarray]:
    """The whole model's logits rows for the victim, step by step."""
    ((_, logits),) = whole_model_reference(tiny_llama, [PROMPT], EXAMPLES + 2, OPTIONS)
    return logits


def link_port(address: str) -> int:
    async def describe() -> int:
        async with ShardClient(address, timeout=10.0) as client:
            return int((await client.describe()).data_paths.frame_link_port)

    port = asyncio.run(describe())
    assert port, "the worker offers no frame link"
    return port


async def exchange(port: int, data: bytes, *, half_close: bool = True) -> LinkStatus | None:
    """Sends ``data`` on a connection of its own (then half-closes it, unless told not to) and
    reads until the worker closes it: its ``STATUS``, or ``None``."""
    peer = await LinkPeer.connect(port)
    try:
        peer.writer.write(data)
        if half_close:
            peer.writer.write_eof()
        await peer.writer.drain()
        return await peer.answer()
    finally:
        peer.close()


def assert_typed(status: LinkStatus | None) -> None:
    """A dropped call, an OK end, or a typed refusal: never the worker's fault."""
    if status is None or status[0] is grpc.StatusCode.OK:
        return
    code, details, trailers = status
    assert code is not grpc.StatusCode.UNKNOWN, status
    assert trailers.get(STATUS_KEY) is not None, status
    assert trailers[STATUS_KEY] != "DGR_E_INTERNAL", status  # a caller's input is never a fault
    assert details.startswith(trailers[STATUS_KEY]), status


def assert_frame_refusal(status: LinkStatus | None) -> None:
    assert status is not None and status[0] is grpc.StatusCode.INVALID_ARGUMENT, status
    assert status[2].get(STATUS_KEY) == "DGR_E_FRAME", status


def _opened(port: int) -> socket.socket:
    """A connection that opens a ``ChainStream`` call and sends nothing more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=LINK_READ_SECONDS)
    sock.sendall(link_open("ChainStream"))
    return sock


def assert_no_leaked_call(port: int, limit: int) -> None:
    """Exactly ``limit`` calls fit in the link now: ``limit`` calls opened (and silent since)
    are held and the next is answered ``RESOURCE_EXHAUSTED`` (a call leaked by an example
    would take one of the ``limit``, and the worker would refuse an earlier one). A
    connection that has not opened a call holds none (``worker/calls/introductions.py``).
    The worker serves the calls in the order it reads their ``OPEN``, each sent before the
    next connection is made; loopback delivers it at once."""
    held = [_opened(port)]
    try:
        held += [_opened(port) for _ in range(limit - 1)]
        extra = _opened(port)
        with extra:
            answer = read_to_end(extra)
        header, payload = fl.HEADER.unpack(answer[: fl.HEADER.size]), answer[fl.HEADER.size :]
        assert header == (len(payload), fl.Kind.STATUS), answer
        code, _, trailers = fl.decode_status(payload)
        assert (code, dict(trailers)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            {STATUS_KEY: "DGR_E_CAPACITY"},
        )
        refused = []
        for i, sock in enumerate(held):
            sock.setblocking(False)  # a socket with a timeout would wait for a byte first
            try:
                sock.recv(1, socket.MSG_PEEK)  # a byte, or b"": the worker closed it
                refused.append(i)
            except BlockingIOError:
                pass
        assert not refused, f"{len(refused)} of {limit} connections refused: calls leaked"
    finally:
        for sock in held:  # each is dropped once the worker sees its end, then closed
            sock.shutdown(socket.SHUT_WR)
        for sock in held:
            read_to_end(sock)
            sock.close()


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(LINK_READ_SECONDS)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


class Fuzzed:
    """A fuzzer's run against one worker: the victim session over its link, one step per
    example, and the checks after the last one."""

    def __init__(self, process: WorkerProcess, loop: Loop, name: str, front: Any = None) -> None:
        self.process, self.loop = process, loop
        self.port = link_port(process.address)
        self.victim = LinkSession(process.address, self.port, f"victim-link-{name}", PROMPT, front)
        self.examples = 0
        loop(self.victim.open())
        loop(self.victim.step())

    def example(self, data: bytes, *, half_close: bool = True) -> LinkStatus | None:
        """Sends one example's bytes; the answer (checked typed); then one victim step."""
        self.examples += 1
        status = self.loop(exchange(self.port, data, half_close=half_close))
        assert_typed(status)
        self.loop(self.victim.step())
        return status

    def finish(self, want: list[np.ndarray]) -> None:
        self.loop(self.victim.close())
        victim = self.victim
        print(f"\n{self.examples} examples, victim {len(victim.logits)} steps exact")
        assert self.examples >= EXAMPLES // 2
        assert self.process.proc.poll() is None, self.process.stderr_text()
        assert victim.exact(want) and len(victim.logits) == self.examples + 1
        assert_healthy(self.process)
        assert "Traceback" not in self.process.stderr_text()
        assert_no_leaked_call(self.port, connection_limit(MAX_SESSIONS))


def test_raw_bytes_on_the_link(worker: WorkerProcess, loop: Loop, want: list[np.ndarray]) -> None:
    fuzzed = Fuzzed(worker, loop, "raw")

    @LINK_FUZZ
    @given(method=st.sampled_from(METHODS), payload=st.binary(max_size=256))
    def fuzz(method: str, payload: bytes) -> None:
        fuzzed.example((link_open(method) if method else b"") + payload)

    fuzz()
    fuzzed.finish(want)


def test_headers_of_any_kind_and_length(
    worker: WorkerProcess, loop: Loop, want: list[np.ndarray]
) -> None:
    """Unknown kinds and lengths over any limit are refused ``DGR_E_FRAME`` by their header
    alone; a ``STATUS`` or ``HALF_CLOSE`` before ``OPEN`` too; a length that says more than is
    sent drops the call when the connection ends."""
    fuzzed = Fuzzed(worker, loop, "headers")
    kinds = {int(k) for k in fl.Kind}

    @LINK_FUZZ
    @given(
        method=st.sampled_from(METHODS),
        kind=st.one_of(st.sampled_from(sorted(kinds)), st.integers(0, 255)),
        length=st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)),
        body=st.binary(max_size=64),
    )
    def fuzz(method: str, kind: int, length: int, body: bytes) -> None:
        opened = link_open(method) if method else b""
        status = fuzzed.example(opened + fl.HEADER.pack(length, kind) + body)
        cap = 2**31 if kind == fl.Kind.MESSAGE else fl.CONTROL_MAX_BYTES  # over any limit
        whole = length <= len(body)  # else the call is dropped when the connection ends
        out_of_place = {
            "": kind != fl.Kind.OPEN,  # a STATUS, HALF_CLOSE or MESSAGE before OPEN
            "ChainStream": kind in (fl.Kind.OPEN, fl.Kind.STATUS),
            "ChainOutput": kind != fl.Kind.MESSAGE,  # in place of the request
        }[method]
        if kind not in kinds or length > cap or (whole and out_of_place):
            assert_frame_refusal(status)

    fuzz()
    fuzzed.finish(want)


def test_generated_frames_on_a_link_stream(
    worker: WorkerProcess, loop: Loop, want: list[np.ndarray]
) -> None:
    real = expectations_of_worker(worker)
    fuzzed = Fuzzed(worker, loop, "frames")

    @LINK_FUZZ
    @given(frames=st.lists(forward_requests(real), min_size=1, max_size=3), end=st.booleans())
    def fuzz(frames: list[pb.ForwardRequest], end: bool) -> None:
        data = link_open() + b"".join(
            fl.pack(fl.Kind.MESSAGE, f.SerializeToString()) for f in frames
        )
        status = fuzzed.example(data + (fl.pack(fl.Kind.HALF_CLOSE) if end else b""))
        assert status is not None and status[0] is not grpc.StatusCode.OK, status  # no secret

    fuzz()
    fuzzed.finish(want)


def test_frames_cut_anywhere(worker: WorkerProcess, loop: Loop, want: list[np.ndarray]) -> None:
    real = expectations_of_worker(worker)
    fuzzed = Fuzzed(worker, loop, "cut")

    @LINK_FUZZ
    @given(frame=forward_requests(real), cut=st.floats(0.0, 1.0, exclude_max=True))
    def fuzz(frame: pb.ForwardRequest, cut: float) -> None:
        whole = (
            link_open()
            + fl.pack(fl.Kind.MESSAGE, frame.SerializeToString())
            + fl.pack(fl.Kind.HALF_CLOSE)
        )
        fuzzed.example(whole[: int(cut * len(whole))])

    fuzz()
    fuzzed.finish(want)


def test_junk_output_requests(worker: WorkerProcess, loop: Loop, want: list[np.ndarray]) -> None:
    """A ``ChainOutput`` whose request is junk bytes, or a request for no session this caller
    holds: refused typed, the worker closing the connection itself."""
    fuzzed = Fuzzed(worker, loop, "output")
    generated = st.builds(
        pb.ChainOutputRequest,
        session_id=session_ids(),
        epoch=st.integers(0, 2**64 - 1),
        session_secret=st.binary(max_size=40),
    ).map(lambda r: r.SerializeToString())

    @LINK_FUZZ
    @given(request=st.one_of(st.binary(max_size=128), generated))
    def fuzz(request: bytes) -> None:
        data = link_open("ChainOutput") + fl.pack(fl.Kind.MESSAGE, request)
        status = fuzzed.example(data, half_close=False)
        assert status is not None and status[0] is not grpc.StatusCode.OK, status

    fuzz()
    fuzzed.finish(want)


def test_frames_of_an_open_session_on_a_later_stage(
    tiny_llama: Path, last_stage: WorkerProcess, loop: Loop, want: list[np.ndarray]
) -> None:
    """Frames of a session open at epoch 2 on layers [2, 4), well-formed but for their
    boundary tensor (any dtype, shape and bytes; NaN and infinite rows among them), their
    secret (right, wrong, none) and their epoch (stale 1, 2, unknown 3, any): answered or
    refused typed, while a session relayed through the same worker stays exact."""
    front = ShardEngine(tiny_llama, layers=(0, 2), **OPTIONS.engine_kwargs())
    try:
        fuzzed = Fuzzed(last_stage, loop, "later", front)
        real = expectations_of_worker(last_stage)
        secret = loop(open_attacker(last_stage.address, real))
        output = loop(open_output(fuzzed.port, secret))
        width = real.boundary_width
        finite = np.ones((1, width), "<f4")
        nan, inf = finite.copy(), finite.copy()
        nan[0, width // 2], inf[0, 0] = np.nan, -np.inf
        refused: dict[str, int] = {}

        @LINK_FUZZ
        @given(
            dtype=st.one_of(st.just(pb.DTYPE_F32), INT32),
            shape=st.one_of(st.just([1, width]), st.lists(st.integers(0, 2**32 - 1), max_size=3)),
            data=st.one_of(
                st.sampled_from([finite.tobytes(), nan.tobytes(), inf.tobytes()]),
                st.binary(max_size=4 * width + 8),
            ),
            key=st.sampled_from([secret, b"", bytes(len(secret))]),
            epoch=st.one_of(st.sampled_from([1, 2, 3]), st.integers(0, 2**64 - 1)),
        )
        def fuzz(dtype: int, shape: list[int], data: bytes, key: bytes, epoch: int) -> None:
            request = encode_forward(
                "mallory", 2, 0, real, [0], boundary=np.ones((1, width)), session_secret=key
            )
            request.epoch = epoch
            request.boundary.dtype = dtype  # type: ignore[assignment]  # an open enum
            del request.boundary.shape[:]
            request.boundary.shape.extend(shape)
            request.boundary.data = data
            frame = fl.pack(fl.Kind.MESSAGE, request.SerializeToString())
            status = fuzzed.example(link_open() + frame + fl.pack(fl.Kind.HALF_CLOSE))
            if status is not None and status[0] is not grpc.StatusCode.OK:
                said = status[2][STATUS_KEY]
                refused[said] = refused.get(said, 0) + 1
            well_formed = (dtype, shape, key, epoch) == (pb.DTYPE_F32, [1, width], secret, 2)
            if well_formed and data in (nan.tobytes(), inf.tobytes()):
                assert status is not None and "non-finite values" in status[1], status
                assert status[2][STATUS_KEY] == "DGR_E_FRAME", status

        fuzz()
        loop(close_attacker(last_stage.address, secret))
        while loop(output.read()) is not None:  # its replies, if a frame ran, then
            pass  # the end: the worker closed the output stream (its call let go first)
        print(f"\nrefusals: {refused}")
        fuzzed.finish(want)
    finally:
        front.close()


def expectations_of_worker(process: WorkerProcess) -> Any:
    async def describe() -> Any:
        async with ShardClient(process.address, timeout=10.0) as client:
            return expectations_of(await client.describe())

    return asyncio.run(describe())


async def open_attacker(address: str, expect: Any) -> bytes:
    async with ShardClient(address, timeout=10.0) as client:
        await client.open("mallory", 2, expect)
        return client.session_secret("mallory", 2)


async def close_attacker(address: str, secret: bytes) -> None:
    request = pb.CloseSessionRequest(session_id="mallory", epoch=2, session_secret=secret)
    async with grpc.aio.insecure_channel(address) as channel:
        await shard_pb2_grpc.ShardStub(channel).CloseSession(request, timeout=10.0)


async def open_output(port: int, secret: bytes) -> fl.FrameLinkCall[Any]:
    """The attacker's output stream over the link, registered (its replies never read)."""
    request = pb.ChainOutputRequest(session_id="mallory", epoch=2, session_secret=secret)
    output = fl.FrameLinkTarget("127.0.0.1", port).ChainOutput(request)
    assert await output.read() == pb.ChainOutputReply()
    return output
