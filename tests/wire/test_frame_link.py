"""The frame link's framing (``dgr_engine/wire/frame_link.py``) under bytes that are not the
protocol: lengths that lie (over the reader's limit, or more than the connection delivers),
unknown kinds, control messages that do not parse. Each is a typed ``LinkProtocolError`` or an
``IncompleteReadError``, never a read that waits for ever or a buffer the header sized."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dgr_engine.wire import frame_link as fl
from tests.harness import run

LIMIT = 1024


async def read_all(data: bytes, max_bytes: int = LIMIT) -> list[tuple[fl.Kind, bytes]]:
    """Every message of ``data`` (a connection that delivers it, then ends)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    messages = []
    while not reader.at_eof():
        messages.append(await fl.read_message(reader, max_bytes))
    return messages


def test_messages_round_trip_in_order() -> None:
    data = (
        fl.pack(fl.Kind.OPEN, fl.encode_open("ChainStream", [("k", "v")]))
        + fl.pack(fl.Kind.MESSAGE, b"\x08\x01")
        + fl.pack(fl.Kind.MESSAGE)
        + fl.pack(fl.Kind.HALF_CLOSE)
    )
    messages = run(read_all(data))
    assert [k for k, _ in messages] == [
        fl.Kind.OPEN,
        fl.Kind.MESSAGE,
        fl.Kind.MESSAGE,
        fl.Kind.HALF_CLOSE,
    ]
    assert fl.decode_open(messages[0][1]) == ("ChainStream", (("k", "v"),))
    assert messages[1][1] == b"\x08\x01" and messages[2][1] == b""


@pytest.mark.parametrize("kind", [0, 5, 77, 255])
def test_an_unknown_kind_is_refused_before_its_payload_is_read(kind: int) -> None:
    data = fl.HEADER.pack(2**32 - 1, kind)  # a length no reader could hold: never read
    with pytest.raises(fl.LinkProtocolError, match=f"unknown message kind {kind}"):
        run(read_all(data))


def test_a_message_over_the_limit_is_refused_by_its_header_alone() -> None:
    with pytest.raises(fl.LinkProtocolError, match=f"MESSAGE message of {LIMIT + 1} bytes"):
        run(read_all(fl.HEADER.pack(LIMIT + 1, fl.Kind.MESSAGE)))
    # exactly the limit is a message
    assert run(read_all(fl.pack(fl.Kind.MESSAGE, bytes(LIMIT)))) == [
        (fl.Kind.MESSAGE, bytes(LIMIT))
    ]


@pytest.mark.parametrize("kind", [fl.Kind.OPEN, fl.Kind.HALF_CLOSE, fl.Kind.STATUS])
def test_a_control_message_has_its_own_smaller_limit(kind: fl.Kind) -> None:
    big = 1 << 30
    header = fl.HEADER.pack(fl.CONTROL_MAX_BYTES + 1, kind)
    with pytest.raises(fl.LinkProtocolError, match="over 65536"):
        run(read_all(header, max_bytes=big))


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00",  # half a header
        fl.HEADER.pack(10, fl.Kind.MESSAGE) + b"abc",  # a length that says more than was sent
        fl.HEADER.pack(1, fl.Kind.OPEN),
    ],
    ids=["half-header", "lying-length", "empty-payload"],
)
def test_a_connection_that_ends_mid_message_is_an_incomplete_read(data: bytes) -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        run(read_all(data))


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xff\xfe", "OPEN is not JSON"),
        (b"[1, 2]", "OPEN is not a JSON object"),
        (b'{"method": "Forward"}', "unknown method 'Forward'"),
        (b'{"method": ["ChainStream"]}', "unknown method"),
        (b'{"method": "ChainStream", "metadata": [["k"]]}', "not a list of"),
        (b'{"method": "ChainStream", "metadata": [["k", 1]]}', "not a list of"),
        (b'{"method": "ChainStream", "metadata": {"k": "v"}}', "not a list of"),
        (b"NaN", "OPEN is not a JSON object"),
    ],
)
def test_an_open_that_does_not_parse_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(fl.LinkProtocolError, match=why):
        fl.decode_open(payload)


def test_a_status_that_does_not_parse_is_refused() -> None:
    for payload in (b"", b"{}", b'{"code": 99}', b'{"code": 0, "details": 5}', b"[]"):
        with pytest.raises(fl.LinkProtocolError):
            fl.decode_status(payload)
    not_found = grpc.StatusCode.NOT_FOUND.value[0]  # a STATUS carries gRPC's number for it
    ok = fl.encode_status(not_found, "gone", [("dgr-status", "DGR_E_X")])
    assert fl.decode_status(ok) == (not_found, "gone", (("dgr-status", "DGR_E_X"),))


@pytest.mark.parametrize("char", ["x", "\u00e9", "\x00", "\U0001f600"])
def test_a_status_with_huge_details_still_fits_a_control_message(char: str) -> None:
    """Details cut to fit, the trailers kept, and still one JSON object (a non-ASCII character
    is escaped to six or twelve bytes: cutting the bytes would leave no JSON at all)."""
    payload = fl.encode_status(
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        char * (4 * fl.CONTROL_MAX_BYTES),
        [("dgr-status", "Y")],
    )
    assert len(payload) <= fl.CONTROL_MAX_BYTES
    code, details, trailers = fl.decode_status(payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and trailers == (("dgr-status", "Y"),)
    assert len(details) >= 1000 and set(details) == {char}


def test_a_status_with_huge_trailers_drops_them_rather_than_its_json() -> None:
    payload = fl.encode_status(fl.INTERNAL, "why", [("k", "v" * fl.CONTROL_MAX_BYTES)])
    assert len(payload) <= fl.CONTROL_MAX_BYTES
    assert fl.decode_status(payload) == (fl.INTERNAL, "", ())


def test_header_seconds_bounds_the_header_and_not_the_payload() -> None:
    async def scenario() -> None:
        silent = asyncio.StreamReader()
        with pytest.raises(TimeoutError):
            await fl.read_message(silent, LIMIT, header_seconds=0.01)
        slow = asyncio.StreamReader()
        slow.feed_data(fl.HEADER.pack(3, fl.Kind.MESSAGE) + b"a")
        reading = asyncio.ensure_future(fl.read_message(slow, LIMIT, header_seconds=0.01))
        done, _ = await asyncio.wait([reading], timeout=0.05)  # well past the header's bound
        assert not done  # waiting for the rest of an announced payload, not timed out
        slow.feed_data(b"bc")
        assert await reading == (fl.Kind.MESSAGE, b"abc")

    run(scenario())
