"""Native links (``native/src/dgr_link.cpp``): rings and chains of shard engines whose frames
go from socket to socket on the engines' own threads give the whole model's greedy tokens, and
bad input gets a typed failure at the stage that saw it, passed on to the client, with the
session's state untouched and an honest session beside it exact."""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr_engine import ShardEngine
from dgr_engine.engine import LinkKeys, LinkSockets, LinkState, NativeLink
from dgr_engine.errors import (
    EngineError,
    FrameRejected,
    PositionMismatch,
    StaleEpoch,
)
from dgr_engine.reference import split_points
from dgr_engine.wire.link_messages import (
    HEADER,
    Kind,
    LinkClosed,
    encode_end,
    encode_rows,
    read_message,
)
from dgr_engine.wire.link_seal import Sealing
from tests.engine.link_route import LinkRoute

PROMPT = [1, 5, 9, 14, 3, 7, 22, 11]
EPOCH = 3


def whole_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """The whole model's greedy tokens, one engine call a token."""
    with ShardEngine(path, max_sessions=1) as whole:
        whole.open_session(1, 1)
        out = whole.forward(1, 1, tokens=prompt, positions=list(range(len(prompt))))
        tokens = [int(np.argmax(out[-1]))]
        while len(tokens) < n:
            pos = len(prompt) + len(tokens) - 1
            out = whole.forward(1, 1, tokens=[tokens[-1]], positions=[pos])
            tokens.append(int(np.argmax(out[-1])))
    return tokens


class Route:
    """Stages of one model, each a native link of every session on it, connected by socket
    pairs; the client holds the first stage's input and the last stage's output. ``sealed``:
    every connection sealed with a key of its own (``wire/link_seal.py``)."""

    def __init__(
        self,
        path: Path,
        n_stages: int,
        *,
        ring: bool,
        sealed: bool = False,
        frames_per_second: float | None = None,
        co_batch_rows: int | None = None,
    ) -> None:
        with ShardEngine(path, max_sessions=1) as probe:
            n_layer = probe.info.n_layer
        self.engines = [
            ShardEngine(path, layers=r, max_sessions=3) for r in split_points(n_layer, n_stages)
        ]
        self.ring, self.sealed, self.rate = ring, sealed, frames_per_second
        self.co_batch_rows = co_batch_rows
        self.links: list[NativeLink] = []
        self.clients: list[socket.socket] = []
        self.fuzzed: list[int] = []

    def open(self, session_id: int, epoch: int = EPOCH) -> LinkRoute:
        n = len(self.engines)
        hops = [socket.socketpair() for _ in range(n + 1)]  # client -> 0 -> ... -> n-1 -> client
        ring = socket.socketpair() if self.ring else None
        keys = [os.urandom(32) for _ in range(n + 2)]  # each connection's: hops, then the ring's
        for i, engine in enumerate(self.engines):
            engine.open_session(session_id, epoch)
            sockets = LinkSockets(
                inbound=hops[i][1],
                outbound=hops[i + 1][0],
                ring_in=ring[1] if ring is not None and i == 0 else None,
                ring_out=ring[0] if ring is not None and i == n - 1 else None,
                keys=LinkKeys(keys[i], keys[i + 1], keys[n + 1], keys[n + 1])
                if self.sealed
                else None,
            )
            self.links.append(
                engine.start_link(
                    session_id,
                    epoch,
                    hop=i,
                    sockets=sockets,
                    body_timeout=1.0,
                    frames_per_second=self.rate,
                    burst=2,
                    co_batch_rows=self.co_batch_rows,
                )
            )
        self.clients += [hops[0][0], hops[n][1]]
        if not self.sealed:
            return LinkRoute(hops[0][0], hops[n][1], epoch, ring=self.ring)
        self.keys = keys
        return LinkRoute(
            hops[0][0],
            hops[n][1],
            epoch,
            ring=self.ring,
            seal_first=Sealing(keys[0]),
            open_output=Sealing(keys[n]),
        )

    def close(self) -> None:
        for engine in self.engines:
            engine.close()  # ends its links first
        for sock in self.clients:
            sock.close()


@pytest.fixture()
def routes() -> Iterator[list[Route]]:
    made: list[Route] = []
    yield made
    for route in made:
        route.close()


@pytest.mark.parametrize(("n_stages", "ring"), [(2, True), (3, True), (2, False), (4, False)])
def test_a_route_of_native_links_gives_the_whole_models_tokens(
    tiny_llama: Path, routes: list[Route], n_stages: int, ring: bool
) -> None:
    expected = whole_greedy(tiny_llama, PROMPT, 12)
    route = Route(tiny_llama, n_stages, ring=ring)
    routes.append(route)
    client = route.open(7)
    turn = client.generate(PROMPT, 0, 12, timeout=30)
    assert list(turn.tokens) == expected
    assert turn.next_pos == len(PROMPT) + 11
    # the next turn goes on from the KV the first left: its last token first
    more = client.generate([turn.tokens[-1]], turn.next_pos, 4, timeout=30)
    assert list(more.tokens) == whole_greedy(tiny_llama, PROMPT, 16)[12:]
    stats = [link.stats() for link in route.links]
    assert all(s.state is LinkState.RUNNING for s in stats)
    assert stats[0].frames == 12 + 4  # each turn: its rows, then one frame a token but the last
    assert stats[-1].tokens == 16
    assert stats[-1].ring_frames == (11 + 3 if ring else 0)
    assert all(s.engine_ns > 0 and s.bytes_in > 0 and s.bytes_out > 0 for s in stats)


def test_a_ring_stops_at_a_stop_token(tiny_llama: Path, routes: list[Route]) -> None:
    expected = whole_greedy(tiny_llama, PROMPT, 10)
    route = Route(tiny_llama, 2, ring=True)
    routes.append(route)
    client = route.open(7)
    stop = expected[4]
    turn = client.generate(PROMPT, 0, 10, stop=[stop], timeout=30)
    assert list(turn.tokens) == expected[: expected.index(stop) + 1]
    # nothing more comes: the ring stopped at the stop token
    with pytest.raises(LinkClosed):
        read_message(client.output, 0.3)


def _raw_header(**fields: int) -> bytes:
    values = dict(
        magic=0x4B4E4C44, version=1, kind=1, epoch=EPOCH, step=0, pos=0, n_rows=1, width=0,
        until=0, n_stop=0, hop=0, value=0, payload=4, reserved=0,
    )  # fmt: skip
    values.update(fields)
    return HEADER.pack(*values.values())


def _failure(client: LinkRoute) -> tuple[str, int, str]:
    header, payload = read_message(client.output, 10)
    assert header.kind is Kind.FAILED
    return header.status, header.hop, payload.decode()


BAD_FIRST_STAGE_INPUT = [
    pytest.param(_raw_header(magic=0xDEADBEEF) + b"\0" * 4, "DGR_E_FRAME", id="magic"),
    pytest.param(_raw_header(kind=9) + b"\0" * 4, "DGR_E_FRAME", id="kind"),
    pytest.param(_raw_header(payload=400) + b"\0" * 400, "DGR_E_FRAME", id="lying-length"),
    pytest.param(_raw_header(n_rows=0, payload=0), "DGR_E_FRAME", id="no-rows"),
    pytest.param(
        _raw_header(n_rows=1 << 30, payload=4 << 30 & 0xFFFFFFFF), "DGR_E_FRAME", id="huge"
    ),
    pytest.param(_raw_header(width=8, payload=36) + b"\0" * 36, "DGR_E_FRAME", id="width"),
    pytest.param(_raw_header(n_stop=99, payload=400) + b"\0" * 400, "DGR_E_FRAME", id="stops"),
    pytest.param(_raw_header(epoch=EPOCH - 1) + b"\0" * 4, "DGR_E_STALE_EPOCH", id="stale"),
    pytest.param(_raw_header(epoch=EPOCH + 1) + b"\0" * 4, "DGR_E_UNKNOWN_SESSION", id="newer"),
    pytest.param(_raw_header(pos=5) + b"\0" * 4, "DGR_E_POSITION", id="position"),
    pytest.param(_raw_header() + struct.pack("<i", 1 << 30), "DGR_E_INVALID_ARGUMENT", id="token"),
    pytest.param(_raw_header(payload=4) + b"\0\0", "DGR_E_FRAME", id="truncated"),
]


@pytest.mark.parametrize(("frame", "status"), BAD_FIRST_STAGE_INPUT)
def test_bad_input_fails_the_link_typed_and_spares_the_session_beside_it(
    tiny_llama: Path, routes: list[Route], frame: bytes, status: str
) -> None:
    route = Route(tiny_llama, 2, ring=True)
    routes.append(route)
    honest = route.open(1)
    hostile = route.open(2)
    hostile.first.sendall(frame)  # "truncated": the rest never comes (the body deadline)
    got, hop, message = _failure(hostile)
    assert (got, hop) == (status, 0), message
    assert message.startswith(status)
    # the hostile session's links have ended (closing joins their threads): how they ended
    first = route.links[2].close()
    assert first.state is LinkState.FAILED and first.status == status and first.frames == 0
    assert route.links[3].close().state is LinkState.FAILED  # passed on to the last stage
    # nothing of the session's state moved, and the session beside it is exact
    assert [engine.next_pos(2, EPOCH) for engine in route.engines] == [0, 0]
    assert list(honest.generate(PROMPT, 0, 8, timeout=30).tokens) == whole_greedy(
        tiny_llama, PROMPT, 8
    )


def test_the_client_reads_a_typed_error(tiny_llama: Path, routes: list[Route]) -> None:
    route = Route(tiny_llama, 2, ring=True)
    routes.append(route)
    client = route.open(1)
    client.generate(PROMPT, 0, 2, timeout=30)
    with pytest.raises(PositionMismatch, match="stage 0"):
        client.generate([5], 0, 2, timeout=30)  # position 0 again: the KV is at 9


def test_non_finite_rows_are_refused_before_the_engine(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, layers=(1, 4), max_sessions=1)
    closing.append(engine)
    engine.open_session(1, EPOCH)
    inbound, outbound = socket.socketpair(), socket.socketpair()
    link = engine.start_link(1, EPOCH, hop=1, sockets=LinkSockets(inbound[1], outbound[0]))
    rows = np.zeros((2, engine.info.in_width), dtype=np.float32)
    rows[1, 3] = np.nan
    inbound[0].sendall(encode_rows(EPOCH, 0, 0, [1, 2], rows=rows, hop=0, trace=[7]))
    header, payload = read_message(outbound[1], 10)
    # the frame's sender is named: stage 0 sent it, stage 1 refused it
    assert (header.kind, header.status, header.hop) == (Kind.FAILED, "DGR_E_FRAME", 0)
    assert "non-finite value in row 1" in payload.decode()
    assert engine.next_pos(1, EPOCH) == 0
    failure = link.close().failure()
    assert isinstance(failure, FrameRejected) and "stage 0" in str(failure)
    for pair in (inbound, outbound):
        pair[0].close()
        pair[1].close()


def test_a_silent_peer_holds_nothing_and_closes_promptly(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, layers=(0, 4), max_sessions=1)
    closing.append(engine)
    engine.open_session(1, EPOCH)
    inbound, outbound = socket.socketpair(), socket.socketpair()
    link = engine.start_link(1, EPOCH, hop=0, sockets=LinkSockets(inbound[1], outbound[0]))
    assert link.stats().state is LinkState.RUNNING  # waits: an idle session is no fault
    began = time.monotonic()
    final = link.close()
    assert time.monotonic() - began < 5
    assert final.state is LinkState.ENDED and final.frames == 0
    engine.close_session(1, EPOCH)  # the slot was never held by the link
    engine.open_session(2, 1)
    with pytest.raises(LinkClosed):
        read_message(outbound[1], 5)  # the link closed its end
    for pair in (inbound, outbound):
        pair[0].close()
        pair[1].close()


def test_a_peer_that_hangs_up_ends_the_link_and_says_so(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, max_sessions=1)
    closing.append(engine)
    engine.open_session(1, EPOCH)
    inbound, outbound = socket.socketpair(), socket.socketpair()
    notify_read, notify_write = os.pipe()
    link = engine.start_link(
        1, EPOCH, hop=0, sockets=LinkSockets(inbound[1], outbound[0]), notify_fd=notify_write
    )
    inbound[0].close()  # the peer hangs up
    ready, _, _ = select.select([notify_read], [], [], 10)
    assert ready and os.read(notify_read, 1) == b"\x01"
    stats = link.stats()
    assert stats.state is LinkState.ENDED and stats.error == "a peer closed its link"
    link.close()
    for fd in (notify_read, notify_write):
        os.close(fd)
    outbound[1].close()


def test_frames_faster_than_the_engine_queue_in_order(
    tiny_llama: Path, routes: list[Route]
) -> None:
    """A chain's client sends a whole teacher-forced sequence at once: each token's answer is
    the whole model's argmax after that prefix."""
    expected = whole_greedy(tiny_llama, PROMPT, 24)
    route = Route(tiny_llama, 3, ring=False)
    routes.append(route)
    client = route.open(1)
    fed = PROMPT + expected[:-1]
    client.first.sendall(
        b"".join(encode_rows(EPOCH, i, i, [t], until_step=0) for i, t in enumerate(fed))
    )
    answers = [read_message(client.output, 30)[0] for _ in fed]
    assert [a.value for a in answers[len(PROMPT) - 1 :]] == expected
    assert [a.step for a in answers] == list(range(len(fed)))


def test_start_refuses_a_session_that_is_not_open(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, max_sessions=1)
    closing.append(engine)
    a, b = socket.socketpair()
    with pytest.raises(EngineError, match="DGR_E_UNKNOWN_SESSION"):
        engine.start_link(1, 1, hop=0, sockets=LinkSockets(a, b))
    engine.open_session(1, 2)
    with pytest.raises(StaleEpoch):
        engine.start_link(1, 1, hop=0, sockets=LinkSockets(a, b))
    assert a.fileno() >= 0 and b.fileno() >= 0  # not taken: the caller still owns them
    a.close()
    b.close()


def test_closing_the_engine_ends_its_running_links(tiny_llama: Path, routes: list[Route]) -> None:
    route = Route(tiny_llama, 2, ring=True)
    client = route.open(1)
    client.generate(PROMPT, 0, 3, timeout=30)
    links = list(route.links)
    route.close()
    assert all(link.closed for link in links)
    assert links[0].stats().state is LinkState.ENDED  # stopped by its engine's close
    # the next stage's input ended without an end message: it may have seen stage 0 lost first
    last = links[1].stats()
    assert last.state is LinkState.ENDED or (last.status, last.failed_hop) == ("DGR_E_LINK_LOST", 0)


def test_an_end_message_ends_every_link_cleanly(tiny_llama: Path, routes: list[Route]) -> None:
    route = Route(tiny_llama, 3, ring=True)
    routes.append(route)
    client = route.open(1)
    client.generate(PROMPT, 0, 3, timeout=30)
    client.first.sendall(encode_end(EPOCH))
    header, _ = read_message(client.output, 10)  # passed on by every stage, to the client
    assert header.kind is Kind.END
    ends = [link.close() for link in route.links]
    assert [(s.state, s.error) for s in ends] == [(LinkState.ENDED, "ended by an end message")] * 3


def test_a_stage_gone_without_an_end_message_is_named_lost(
    tiny_llama: Path, routes: list[Route]
) -> None:
    """A middle stage's link ends without an end message (its process died, or its worker
    closed the session): the stage after it reports it lost, on to the client, which reads
    the stage's index."""
    route = Route(tiny_llama, 3, ring=True)
    routes.append(route)
    client = route.open(1)
    client.generate(PROMPT, 0, 2, timeout=30)
    route.links[1].close()  # stage 1 goes away
    status, hop, message = _failure(client)
    assert (status, hop) == ("DGR_E_LINK_LOST", 1), message
    after = route.links[2].close()  # joins its thread: it has ended
    assert after.state is LinkState.FAILED and after.failed_hop == 1


def test_malformed_frames_are_typed_for_the_client(tiny_llama: Path, routes: list[Route]) -> None:
    route = Route(tiny_llama, 2, ring=False)
    routes.append(route)
    client = route.open(1)
    client.first.sendall(_raw_header(n_rows=0, payload=0))
    with pytest.raises(FrameRejected, match="stage 0"):
        client.generate([1], 0, 1, timeout=30)


# --- the fuzzer: any bytes, any header, at any stage --------------------------------------

FIELD_ORDER = (
    "magic", "version", "kind", "epoch", "step", "pos", "n_rows", "width", "until", "n_stop",
    "hop", "value", "payload", "reserved",
)  # fmt: skip
FIELDS = st.fixed_dictionaries(
    {
        "magic": st.sampled_from([0x4B4E4C44, 0x4B4E4C44, 0, 0xFFFFFFFF]),
        "version": st.sampled_from([1, 1, 0, 2]),
        "kind": st.integers(0, 8),
        "epoch": st.sampled_from([EPOCH, EPOCH, EPOCH - 1, EPOCH + 1, 2**64 - 1]),
        "step": st.integers(0, 2**32 - 1),
        "pos": st.integers(-(2**31), 2**31 - 1),
        "n_rows": st.sampled_from([0, 1, 2, 3, 64, 65, 2**32 - 1]),
        "width": st.sampled_from([0, 1, 64, 2**32 - 1]),
        "until": st.integers(0, 2**32 - 1),
        "n_stop": st.sampled_from([0, 1, 16, 17, 2**32 - 1]),
        "hop": st.integers(0, 2**32 - 1),
        "value": st.integers(-(2**31), 2**31 - 1),
        "payload": st.sampled_from([0, 4, 8, 12, 2**20, 2**32 - 1]),
        "reserved": st.integers(0, 2**32 - 1),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stage=st.integers(0, 1),
    fields=FIELDS,
    body=st.binary(max_size=96),
    nan_rows=st.booleans(),
    cut=st.booleans(),
    seal=st.sampled_from(["clear", "sealed with its key", "clear to a sealed link"]),
)
def test_fuzzed_input_fails_typed_and_the_honest_session_stays_exact(
    fuzz_route: tuple[Route, list[int]],
    stage: int,
    fields: dict[str, int],
    body: bytes,
    nan_rows: bool,
    cut: bool,
    seal: str,
) -> None:
    """Hypothesis sends any header and any bytes (rows of NaN among them, or a frame cut
    short) to a hostile session's link on either stage of a 2-stage ring, in the clear, or to a
    sealed link sealed with its own key (so the checks after the seal see every header) or in
    the clear: that link fails with a typed status (never ``DGR_E_INTERNAL``) or ends, never
    crashes or hangs, its session's state is untouched, and an honest session on the same
    engines keeps the whole model's tokens."""
    route, expected = fuzz_route
    engine = route.engines[stage]
    sid = 100 + len(route.fuzzed)
    route.fuzzed.append(sid)
    engine.open_session(sid, EPOCH)
    inbound, outbound = socket.socketpair(), socket.socketpair()
    ended, notify = os.pipe()
    key_in, key_out = os.urandom(32), os.urandom(32)
    keys = LinkKeys(key_in, key_out) if seal != "clear" else None
    link = engine.start_link(
        sid,
        EPOCH,
        hop=stage,
        sockets=LinkSockets(inbound[1], outbound[0], keys=keys),
        body_timeout=0.2,
        notify_fd=notify,
    )
    data = HEADER.pack(*(fields[name] for name in FIELD_ORDER)) + body
    if nan_rows and stage == 1:
        rows = np.full((1, engine.info.in_width), np.nan, dtype=np.float32)
        data = encode_rows(EPOCH, 0, 0, [1], rows=rows, trace=[0])
    if seal == "sealed with its key":
        data = Sealing(key_in).seal(data)
    if cut:
        data = data[: max(1, len(data) // 2)]
    try:
        inbound[0].sendall(data)
        inbound[0].shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the link refused and closed already
    # the link ends by itself: its input ended (a frame it could not take, or the end of it)
    assert select.select([ended], [], [], 30)[0], "the link did not end"
    final = link.close()
    opener = Sealing(key_out) if keys is not None else None
    while True:  # what it sent on is well-formed link messages, to the end of its socket
        try:
            read_message(outbound[1], 5, opener=opener)
        except LinkClosed:
            break
    os.close(ended)
    os.close(notify)
    assert final.state in (LinkState.ENDED, LinkState.FAILED)
    if final.state is LinkState.FAILED:
        assert final.status.startswith("DGR_E_") and final.failed_hop <= stage, final
        if final.failed_hop == stage:  # its own refusal (else a stage before's, passed on)
            assert final.status != "DGR_E_INTERNAL", final
    if final.frames == 0:  # nothing ran: the session is where it was
        assert engine.next_pos(sid, EPOCH) == 0
    engine.close_session(sid, EPOCH)
    for pair in (inbound, outbound):
        pair[0].close()
        pair[1].close()
    honest = route.open(sid)
    assert list(honest.generate(PROMPT, 0, 4, timeout=30).tokens) == expected
    for s in (honest.first, honest.output):
        s.close()
    for link_ in route.links:
        link_.close()
    route.links.clear()
    for e in route.engines:
        e.close_session(sid, EPOCH)


@pytest.fixture(scope="module")
def fuzz_route(tiny_llama: Path) -> Iterator[tuple[Route, list[int]]]:
    route = Route(tiny_llama, 2, ring=True)
    yield route, whole_greedy(tiny_llama, PROMPT, 4)
    route.close()


def test_a_session_over_its_frame_budget_waits_for_its_turn_and_stays_exact(
    tiny_llama: Path, routes: list[Route]
) -> None:
    """The worker's per-session frame rate, kept by the link itself: frames over a budget of
    40 a second (a burst of 2) wait in the link, none is refused, and the tokens are the whole
    model's; a frame cannot run before its turn, so 10 frames take at least 8 / 40 s."""
    expected = whole_greedy(tiny_llama, PROMPT, 10)
    route = Route(tiny_llama, 2, ring=True, frames_per_second=40.0)
    routes.append(route)
    client = route.open(7)
    began = time.monotonic()
    turn = client.generate(PROMPT, 0, 10, timeout=30)
    assert time.monotonic() - began >= (10 - 2) / 40.0
    assert list(turn.tokens) == expected
    client.first.sendall(encode_end(EPOCH))  # round every stage: the counts are final then
    assert read_message(client.output, 10)[0].kind is Kind.END
    stats = [link.stats() for link in route.links]
    assert all(s.failure() is None and s.frames == 10 for s in stats)
    # the first stage held the frames back (the next ones come at the budget's pace)
    assert stats[0].throttled >= 1 and stats[0].throttled_ns > 0
    assert stats[0].busy_ns < stats[0].throttled_ns  # the waits are not busy time


def test_a_frame_waiting_for_its_budget_ends_at_once_when_the_link_stops(
    tiny_llama: Path, routes: list[Route]
) -> None:
    route = Route(tiny_llama, 2, ring=True, frames_per_second=0.01)  # one frame a 100 s
    routes.append(route)
    client = route.open(7)
    client.first.sendall(encode_rows(EPOCH, 0, 0, PROMPT, until_step=5))
    header, _ = read_message(client.output, 30)  # two frames ran (the burst): one token
    assert header.kind is Kind.TOKEN
    first = route.links[0]
    began = time.monotonic()
    first.close()  # its third frame (the ring's second) waits for its budget: it ends now
    assert time.monotonic() - began < 10.0
    assert first.stats().state is LinkState.ENDED


@pytest.mark.parametrize("sealed", [False, True])
def test_links_co_batch_the_frames_that_wait_together_and_every_session_stays_exact(
    tiny_llama: Path, routes: list[Route], sealed: bool
) -> None:
    """Three rings on the same two engines, their links in one co-batching group each: the
    frames that wait for an engine together run in one call (``dgr_forward_batch``), and each
    session's tokens are the whole model's alone."""
    n = 24
    prompts = [PROMPT, PROMPT[::-1], PROMPT[2:] + PROMPT[:2]]
    expected = [whole_greedy(tiny_llama, p, n) for p in prompts]
    route = Route(tiny_llama, 2, ring=True, sealed=sealed, co_batch_rows=64)
    routes.append(route)
    clients = [route.open(session) for session in (1, 2, 3)]
    for client, prompt in zip(clients, prompts, strict=True):  # the rings run by themselves
        client._send(encode_rows(EPOCH, 0, 0, prompt, until_step=n - 1))
    for client, want in zip(clients, expected, strict=True):
        got = [read_message(client.output, 30, opener=client._open)[0] for _ in range(n)]
        assert [h.value for h in got if h.kind is Kind.TOKEN] == want
        client._send(encode_end(EPOCH))  # round every stage: the counts are final then
        assert read_message(client.output, 10, opener=client._open)[0].kind is Kind.END
    stats = [link.stats() for link in route.links]
    assert all(s.failure() is None and s.frames == n for s in stats)
    assert sum(s.co_batched for s in stats) > 0
    for engine in route.engines:
        calls, frames = engine.co_batch_stats()
        assert frames == 3 * n and calls < frames  # some calls ran several sessions' frames
