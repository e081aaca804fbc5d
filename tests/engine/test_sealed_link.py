"""Sealed native links (``wire/link_seal.py``, ``dgr_link_start_sealed``): every message after the
introductions is ChaCha20-Poly1305-sealed with its connection's key and its number. Sealed
routes give the whole model's tokens; a frame sealed with another key, replayed, reordered,
altered or sent in the clear ends the link ``DGR_E_UNAUTHENTICATED`` before the engine sees
it, and an honest sealed session beside it stays exact. The introductions prove the session
secret both ways without sending it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from dgr_engine.errors import GrantUnauthenticated
from dgr_engine.wire.link_messages import (
    HEADER,
    Kind,
    Role,
    decode_hello,
    encode_end,
    encode_hello,
    encode_rows,
    read_message,
)
from dgr_engine.wire.link_messages import parse_header as parse
from dgr_engine.wire.link_seal import Dialer, Sealing, answer_hello
from tests.engine.test_native_link import EPOCH, PROMPT, Route, whole_greedy

SECRET = bytes(range(16))


@pytest.fixture()
def routes() -> Iterator[list[Route]]:
    made: list[Route] = []
    yield made
    for route in made:
        route.close()


@pytest.mark.parametrize(("n_stages", "ring"), [(2, True), (3, False)])
def test_a_sealed_route_gives_the_whole_models_tokens(
    tiny_llama: Path, routes: list[Route], n_stages: int, ring: bool
) -> None:
    expected = whole_greedy(tiny_llama, PROMPT, 10)
    route = Route(tiny_llama, n_stages, ring=ring, sealed=True)
    routes.append(route)
    client = route.open(7)
    turn = client.generate(PROMPT, 0, 10, timeout=30)
    assert list(turn.tokens) == expected
    # an END, sealed too, goes round every stage to the client: the links' counts are final
    client._send(encode_end(EPOCH))
    header, _ = read_message(client.output, 10, opener=client._open)
    assert header.kind is Kind.END
    assert all(link.stats().frames == 10 for link in route.links)


def _refused(route: Route, session_id: int, tamper: str) -> str:
    """Opens a sealed session, sends its first frame ``tamper``ed and returns the failure's
    message the client reads (sealed, as every message on the route)."""
    client = route.open(session_id)
    key = route.keys[0]
    frame = encode_rows(EPOCH, 0, 0, PROMPT, until_step=3)
    if tamper == "wrong key":
        wire = Sealing(os.urandom(32)).seal(frame)
    elif tamper == "in the clear":
        wire = frame + bytes(16)
    elif tamper == "header altered":
        altered = bytearray(Sealing(key).seal(frame))
        altered[20] ^= 1  # the position: in the clear, but authenticated
        wire = bytes(altered)
    elif tamper == "payload altered":
        altered = bytearray(Sealing(key).seal(frame))
        altered[HEADER.size] ^= 0x80
        wire = bytes(altered)
    else:  # "replayed": message 0 again where message 1 is due
        wire = Sealing(key).seal(frame)
        client.first.sendall(wire)
    client.first.sendall(wire)
    for _ in range(8):  # a replay's first copy runs: its tokens come first
        header, payload = read_message(client.output, 10, opener=client._open)
        if header.kind is Kind.FAILED:
            return payload.decode(errors="replace")
    raise AssertionError("no failure came")


@pytest.mark.parametrize(
    "tamper", ["wrong key", "in the clear", "header altered", "payload altered", "replayed"]
)
def test_a_frame_that_fails_its_seal_is_refused_and_the_session_beside_stays_exact(
    tiny_llama: Path, routes: list[Route], tamper: str
) -> None:
    expected = whole_greedy(tiny_llama, PROMPT, 8)
    route = Route(tiny_llama, 2, ring=True, sealed=True)
    routes.append(route)
    honest = route.open(1)
    message = _refused(route, 2, tamper)
    assert "DGR_E_UNAUTHENTICATED" in message
    refused = route.links[-2]  # the refused session's first stage
    assert refused.stats().failure() is not None
    ran = refused.stats().frames
    assert ran >= 1 if tamper == "replayed" else ran == 0  # nothing tampered reached the engine
    assert list(honest.generate(PROMPT, 0, 8, timeout=30).tokens) == expected


def test_the_seal_is_rfc_8439_chacha20_poly1305() -> None:
    key = os.urandom(32)
    frame = encode_rows(EPOCH, 4, 9, [1, 2, 3], until_step=7, stop=[5])
    sealing = Sealing(key)
    for number in range(3):
        wire = sealing.seal(frame)
        head, body = wire[: HEADER.size], wire[HEADER.size :]
        assert head == frame[: HEADER.size] and body[:-16] != frame[HEADER.size :]
        nonce = number.to_bytes(8, "little") + bytes(4)
        assert ChaCha20Poly1305(key).decrypt(nonce, body, head) == frame[HEADER.size :]
    opening = Sealing(key)
    sealing = Sealing(key)
    assert opening.open(frame[: HEADER.size], sealing.seal(frame)[HEADER.size :]) == frame[56:]
    with pytest.raises(GrantUnauthenticated, match="DGR_E_UNAUTHENTICATED"):
        again = Sealing(key).seal(frame)  # message 0 where message 1 is due
        opening.open(again[: HEADER.size], again[HEADER.size :])
    assert opening.count == 1


def test_the_introductions_prove_the_secret_both_ways_without_sending_it() -> None:
    dialer = Dialer(Role.INPUT, "session-1", 4, SECRET, 1)
    wire = encode_hello(dialer.hello)
    assert SECRET not in wire
    hello = decode_hello(parse(wire[: HEADER.size], 4096), wire[HEADER.size :])
    assert hello.sealed
    answer, answerer = answer_hello(hello, SECRET)
    assert SECRET not in answer
    keys = dialer.keys(answer)
    assert (keys.send, keys.receive) == (answerer.receive, answerer.send)
    assert keys.send != keys.receive
    # a fresh introduction gives fresh keys
    again = Dialer(Role.INPUT, "session-1", 4, SECRET, 1)
    assert again.keys(answer_hello(again.hello, SECRET)[0]).send != keys.send
    # the wrong secret, either way, and an introduction altered on the way are refused
    with pytest.raises(GrantUnauthenticated):
        answer_hello(hello, bytes(16))
    with pytest.raises(GrantUnauthenticated):
        Dialer(Role.INPUT, "session-1", 4, bytes(16), 1).keys(answer)
    with pytest.raises(GrantUnauthenticated):
        dialer.keys(answer_hello(hello, SECRET)[0][:-1] + b"\0")
    for altered in (
        Dialer(Role.OUTPUT, "session-1", 4, SECRET, 1).hello,
        dialer.hello.__class__(Role.INPUT, "session-1", 5, hello.secret, 1, sealed=True),
        dialer.hello.__class__(Role.INPUT, "session-1", 4, hello.secret, 2, sealed=True),
        dialer.hello.__class__(Role.RING, "session-1", 4, hello.secret, 1, sealed=True),
    ):
        if altered.secret == hello.secret:
            with pytest.raises(GrantUnauthenticated):
                answer_hello(altered, SECRET)
    with pytest.raises(GrantUnauthenticated):  # a clear introduction where a sealed one is due
        answer_hello(dialer.hello.__class__(Role.INPUT, "session-1", 4, SECRET, 1), SECRET)
