"""One contract for every data path (issue 47): one corpus of malformed frames, drawn by
hypothesis, sent by a hostile "stage 0" to stage 1 over gRPC, the frame link and a native link,
each beside an honest session on the same stage. Every path refuses each frame with the same
status (``DGR_E_FRAME``) and the same fault kind, names the stage that sent it (stage 0, not the
stage that refused it, and never the user: no ``bad_request``, so no ``RequestRefused``), and
the honest session's output stays the whole model's, bit for bit.

The stage is an in-process ``ShardWorker`` of tiny-llama's layers [1, n) (gRPC and the frame
link: the worker's own servicers) and an engine of the same layers running native links over
socket pairs (the C checks a worker's native link port runs); an engine of layers [0, 1) makes
the honest boundary rows. The corpus is drawn once (hypothesis, derandomized: the same corpus
every run) and replayed on each path; every read is bounded.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr_engine.engine import LinkSockets, ShardEngine
from dgr_engine.errors import ShardError
from dgr_engine.reference import whole_model_reference
from dgr_engine.status import STATUSES, Status, error_for_code
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire import link_messages as lm
from dgr_engine.wire.frames import encode_forward
from dgr_engine.wire.metadata import CHAIN_SENDER_KEY
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import CHAIN_HOP_KEY, error_from_trailers, grpc_code
from dgr_session.faults import FaultKind
from tests import harness
from tests.harness import LinkPeer, LinkSession
from tests.worker.test_frame_link_server import OPTIONS, PROMPT, serving

EPOCH = 1
SENDER = 0
"""The hostile frames' sender: stage 0, sending to stage 1."""
READ_SECONDS = harness.LINK_READ_SECONDS
GARBAGE = b"\xff\xff\xff\xff"
"""A protobuf field tag whose varint never ends."""


@attrs.frozen
class BadFrame:
    """One malformed frame, said once for every path."""

    what: str
    """``nan``/``inf``: a non-finite boundary value at (``row``, ``col``); ``width``: rows
    ``delta`` floats too wide or narrow; ``no_rows``: a frame of no rows; ``not_a_message``:
    ``junk`` where a frame was due."""
    row: int = 0
    col: int = 0
    delta: int = 0
    junk: bytes = b""

    def rows(self, honest: np.ndarray) -> np.ndarray:
        """The boundary rows this frame carries in place of ``honest``."""
        rows = np.array(honest, dtype=np.float32, copy=True)
        if self.what in ("nan", "inf"):
            value = np.nan if self.what == "nan" else (np.inf if self.col % 2 else -np.inf)
            rows[self.row % rows.shape[0], self.col % rows.shape[1]] = value
        elif self.what == "width":
            width = max(1, rows.shape[1] + self.delta)
            rows = np.resize(rows, (rows.shape[0], width)).astype(np.float32)
        elif self.what == "no_rows":
            rows = rows[:0]
        return rows


BAD_FRAMES = st.one_of(
    st.builds(
        BadFrame, st.sampled_from(["nan", "inf"]), row=st.integers(0, 64), col=st.integers(0, 4096)
    ),
    st.builds(BadFrame, st.just("width"), delta=st.integers(-8, 8).filter(bool)),
    st.builds(BadFrame, st.just("no_rows")),
    st.builds(
        BadFrame,
        st.just("not_a_message"),
        junk=st.binary(min_size=lm.HEADER.size, max_size=lm.HEADER.size + 16).map(
            lambda tail: GARBAGE + tail  # parses as no protobuf, and is no link header's magic
        ),
    ),
)


def _corpus() -> list[BadFrame]:
    drawn: list[BadFrame] = []

    @settings(
        max_examples=14,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(BAD_FRAMES)
    def draw(frame: BadFrame) -> None:
        drawn.append(frame)

    draw()
    kinds = {f.what for f in drawn}
    assert kinds == {"nan", "inf", "width", "no_rows", "not_a_message"}, kinds
    return drawn


CORPUS = _corpus()


@attrs.frozen
class Verdict:
    """How one path refused one frame: its status, the fault kind a route session files it
    under, and the stage it names."""

    status: str
    fault: FaultKind
    blamed: int

    @classmethod
    def of(cls, error: ShardError, blamed: int) -> Verdict:
        return cls(str(error.status), error.fault_kind, blamed)


EXPECTED = Verdict(Status.FRAME, STATUSES[Status.FRAME].fault_kind, SENDER)


@pytest.fixture(scope="module")
def n_layer(tiny_llama: Path) -> int:
    with ShardEngine(tiny_llama, max_sessions=1) as probe:
        return probe.info.n_layer


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[np.ndarray]:
    ((_, logits),) = whole_model_reference(tiny_llama, [PROMPT], len(CORPUS) + 2, OPTIONS)
    return logits


@pytest.fixture
def front(tiny_llama: Path) -> Iterator[ShardEngine]:
    with ShardEngine(tiny_llama, layers=(0, 1), **OPTIONS.engine_kwargs()) as engine:
        yield engine


# --- gRPC and the frame link: the worker's own servicers ---------------------------------------


def _verdict(code: grpc.StatusCode, details: str, trailers: Any) -> Verdict:
    """A refused chained stream's end, as the client reads it."""
    pairs = list(trailers or ())
    error = error_from_trailers(code, pairs, details)
    hops = [v for k, v in pairs if k == CHAIN_HOP_KEY]
    return Verdict.of(error, int(hops[0]) if hops else -1)


async def _refused(call: Any) -> Verdict:
    """The end of a refused stream: a gRPC call's, or a frame link call's (its code: gRPC's
    number)."""
    async with asyncio.timeout(READ_SECONDS):
        with pytest.raises((grpc.aio.AioRpcError, fl.LinkCallFailed)) as refused:
            while await call.read() not in (None, grpc.aio.EOF):
                pass
    exc = refused.value
    if isinstance(exc, fl.LinkCallFailed):
        return _verdict(grpc_code(exc.code), exc.details, exc.trailers)
    return _verdict(exc.code(), exc.details() or "", exc.trailing_metadata())


def _hostile_frame(session: LinkSession, bad: BadFrame, in_width: int) -> pb.ForwardRequest:
    """Stage 0's frame to stage 1 (``chain_hop`` 1) of the session's first step, made bad."""
    n = len(PROMPT)
    rows = bad.rows(np.zeros((n, in_width), dtype=np.float32))
    positions = np.arange(rows.shape[0], dtype=np.int32)
    request = encode_forward(
        session.session_id,
        1,
        0,
        session.expect,
        positions,
        boundary=rows,
        logit_rows=[rows.shape[0] - 1] if rows.shape[0] else None,
        session_secret=session.secret,
    )
    request.chain_hop = 1
    return request


async def _junk(
    worker: Any, path: str, junk: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> Verdict:
    """A ``ChainStream`` (opened with ``metadata``) whose one message is ``junk``, not a
    frame."""
    if path == "grpc":
        async with grpc.aio.insecure_channel(worker.address) as channel:
            call = channel.stream_stream(
                "/dgr.shard.v1.Chain/ChainStream",
                request_serializer=lambda b: b,
                response_deserializer=pb.ChainAck.FromString,
            )(metadata=metadata)
            await call.write(junk)
            return await _refused(call)
    peer = await LinkPeer.connect(worker.frame_link_port)
    try:
        opening = fl.pack(fl.Kind.OPEN, fl.encode_open("ChainStream", list(metadata)))
        await peer.send(opening + fl.pack(fl.Kind.MESSAGE, junk))
        code, details, trailers = await peer.status()
    finally:
        peer.close()
    return _verdict(code, details, trailers.items())


async def _close(address: str, session: LinkSession) -> None:
    request = pb.CloseSessionRequest(
        session_id=session.session_id, epoch=1, session_secret=session.secret
    )
    async with grpc.aio.insecure_channel(address) as channel:
        await shard_pb2_grpc.ShardStub(channel).CloseSession(request, timeout=READ_SECONDS)


async def _over_servicers(
    worker: Any, front: ShardEngine, path: str, want: list[np.ndarray], in_width: int
) -> list[Verdict]:
    verdicts = []
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = shard_pb2_grpc.ChainStub(channel)

        def session(session_id: str, engine: ShardEngine | None) -> LinkSession:
            made = LinkSession(worker.address, worker.frame_link_port, session_id, PROMPT, engine)
            if path == "grpc":
                made.target = stub  # type: ignore[assignment] # the same calls, over gRPC
            return made

        honest = session("honest", front)
        await honest.open()
        for n, bad in enumerate(CORPUS):
            if bad.what == "not_a_message":
                verdicts.append(await _junk(worker, path, bad.junk))
            else:
                hostile = session(f"hostile-{n}", None)
                await hostile.open()
                assert hostile.stream is not None and hostile.output is not None
                await hostile.stream.write(_hostile_frame(hostile, bad, in_width))
                verdicts.append(await _refused(hostile.stream))
                hostile.output.cancel()
                await _close(worker.address, hostile)
            await honest.step()  # the session beside goes on
        assert honest.exact(want), path
        await honest.close()
    return verdicts


# --- native links: the C checks -----------------------------------------------------------------


class _Link:
    """A native link of one session on the stage's engine (hop 1), over socket pairs: ``inbound``
    is the stage before's end, ``outbound`` the client's."""

    def __init__(self, engine: ShardEngine, session_id: int) -> None:
        self.inbound, self.outbound = socket.socketpair(), socket.socketpair()
        engine.open_session(session_id, EPOCH)
        self.link = engine.start_link(
            session_id,
            EPOCH,
            hop=1,
            sockets=LinkSockets(self.inbound[1], self.outbound[0]),
            body_timeout=1.0,
        )

    def send(self, data: bytes) -> None:
        self.inbound[0].sendall(data)

    def read(self) -> tuple[lm.Header, bytes]:
        return lm.read_message(self.outbound[1], READ_SECONDS)

    def close(self) -> None:
        self.link.close()
        for pair in (self.inbound, self.outbound):
            pair[0].close()
            pair[1].close()


def _failed(header: lm.Header, payload: bytes) -> Verdict:
    """A native link's ``FAILED``, as the client reads it."""
    assert header.kind is lm.Kind.FAILED, header
    error = error_for_code(header.value, payload.decode(errors="replace"))
    return Verdict.of(error, header.hop)


def _native_message(bad: BadFrame, rows: np.ndarray, tokens: list[int]) -> bytes:
    if bad.what == "not_a_message":
        return bad.junk
    bad_rows = bad.rows(rows)
    if bad.what == "no_rows":
        fields = (lm.MAGIC, lm.VERSION, lm.Kind.ROWS, EPOCH, 0, 0, 0, rows.shape[1])
        return lm.HEADER.pack(*fields, 0, 0, 0, 0, 4, 0) + b"\0" * 4
    return lm.encode_rows(EPOCH, 0, 0, tokens, rows=bad_rows, hop=0, trace=[7])


def _over_native_links(
    tiny_llama: Path, n_layer: int, front: ShardEngine, want: list[np.ndarray]
) -> list[Verdict]:
    engine = ShardEngine(tiny_llama, layers=(1, n_layer), **OPTIONS.engine_kwargs())
    verdicts: list[Verdict] = []
    honest = _Link(engine, 1)
    try:
        front.open_session(1, EPOCH)
        tokens, pos = list(PROMPT), 0
        greedy: list[int] = []
        for n, bad in enumerate(CORPUS):
            positions = np.arange(pos, pos + len(tokens), dtype=np.int32)
            rows = front.forward(1, EPOCH, positions, tokens=np.asarray(tokens, np.int32))
            hostile = _Link(engine, 2)
            try:
                hostile.send(_native_message(bad, rows, tokens))
                verdicts.append(_failed(*hostile.read()))
            finally:
                hostile.close()
                engine.close_session(2, EPOCH)
            honest.send(lm.encode_rows(EPOCH, n, pos, tokens, rows=rows, hop=0, trace=[7]))
            header, _ = honest.read()
            assert header.kind is lm.Kind.TOKEN, header
            greedy.append(header.value)
            pos += len(tokens)
            tokens = [header.value]
        assert greedy == [int(np.argmax(row)) for row in want[: len(greedy)]]
    finally:
        honest.close()
        engine.close()
    return verdicts


# --- the contract ---------------------------------------------------------------------------------


def test_every_path_refuses_a_peers_bad_frame_alike_and_blames_the_sender(
    tiny_llama: Path, n_layer: int, front: ShardEngine, want: list[np.ndarray]
) -> None:
    native = _over_native_links(tiny_llama, n_layer, front, want)
    front.close_session(1, EPOCH)
    with ShardEngine(tiny_llama, layers=(1, n_layer), max_sessions=1) as probe:
        in_width = probe.info.in_width

    async def servicers() -> dict[str, list[Verdict]]:
        got = {}
        async with serving(tiny_llama, (1, n_layer)) as worker:
            for path in ("grpc", "frame"):
                got[path] = await _over_servicers(worker, front, path, want, in_width)
        return got

    by_path = {"native": native, **harness.run(servicers(), 300.0)}
    for path, verdicts in by_path.items():
        assert len(verdicts) == len(CORPUS), path
        for bad, verdict in zip(CORPUS, verdicts, strict=True):
            assert verdict == EXPECTED, (path, bad, verdict)
    assert EXPECTED.fault is not FaultKind.BAD_REQUEST  # a peer's frame is no user's request


# --- a ring's first stage: its ring input comes from the ring's last stage ----------------------

RING_SENDER = 3
"""The ring's last stage, which sends the first stage its ring frames."""


def _native_first_stage_verdicts(tiny_llama: Path, n_layer: int, junk: bytes) -> list[Verdict]:
    """``junk`` on a first stage's ring input, then on its client input: what each names."""
    verdicts = []
    with ShardEngine(tiny_llama, layers=(0, n_layer), **OPTIONS.engine_kwargs()) as engine:
        for via_ring in (True, False):
            inbound, ring_in, outbound = (socket.socketpair() for _ in range(3))
            engine.open_session(1, EPOCH)
            sockets = LinkSockets(
                inbound[1], outbound[0], ring_in=ring_in[1], ring_in_hop=RING_SENDER
            )
            link = engine.start_link(1, EPOCH, hop=0, sockets=sockets, body_timeout=1.0)
            try:
                (ring_in if via_ring else inbound)[0].sendall(junk)
                verdicts.append(_failed(*lm.read_message(outbound[1], READ_SECONDS)))
            finally:
                link.close()
                engine.close_session(1, EPOCH)
                for pair in (inbound, ring_in, outbound):
                    pair[0].close()
                    pair[1].close()
    return verdicts


async def _servicer_first_stage_verdict(worker: Any, path: str, sender: str | None) -> Verdict:
    """A frame that is no message on a first stage's ``ChainStream``, opened as from
    ``sender`` (a ring's last stage names itself so; the client's stream names nobody)."""
    metadata = () if sender is None else ((CHAIN_SENDER_KEY, sender),)
    return await _junk(worker, path, GARBAGE + b"\0" * 8, metadata)


def test_a_malformed_ring_frame_at_the_first_stage_names_the_rings_last_stage(
    tiny_llama: Path, n_layer: int
) -> None:
    """On a ring the first stage's frames also come from the ring's last stage: a malformed
    one names that stage, on every path (not the first stage, which refused it); the client's
    own stream still names the first stage, as before."""
    ring, client = _native_first_stage_verdicts(tiny_llama, n_layer, GARBAGE + b"\0" * 60)
    assert ring == attrs.evolve(EXPECTED, blamed=RING_SENDER), ring
    assert client == attrs.evolve(EXPECTED, blamed=0), client

    async def servicers() -> list[tuple[str, Verdict, Verdict]]:
        got = []
        async with serving(tiny_llama, (0, n_layer)) as worker:
            for path in ("grpc", "frame"):
                ring = await _servicer_first_stage_verdict(worker, path, str(RING_SENDER))
                client = await _servicer_first_stage_verdict(worker, path, None)
                got.append((path, ring, client))
        return got

    for path, ring, client in harness.run(servicers(), 120.0):
        assert ring == attrs.evolve(EXPECTED, blamed=RING_SENDER), (path, ring)
        assert client == attrs.evolve(EXPECTED, blamed=0), (path, client)
