"""Sealed native links (``docs/native-path.md``, "Sealed links"): the authenticated encryption a
worker with TLS puts on its native links, keyed from the TLS-protected control channel.

Every native link connection starts with a ``HELLO`` from the side that connects (the dialer:
a client, or the stage before) and the answering stage's reply. On a sealed connection neither
carries the session secret (which the open answered over TLS, and which both sides hold);
each proves it holds it instead:

* the dialer sends a fresh 16-byte nonce and ``BLAKE2b(key=secret, person="dgr-link-dialer",
  transcript)``, the transcript being the introduction (role, ring flag, epoch, the hop it
  introduces itself to, the session id) and its nonce;
* the answerer checks that proof in constant time and answers its own fresh nonce and
  ``BLAKE2b(key=secret, person="dgr-link-answer", transcript + its nonce)``, which the dialer
  checks before it sends a frame;
* both derive the connection's two keys, ``BLAKE2b(key=secret, person="dgr-link-keys",
  transcript + answerer's nonce)`` (64 bytes): the first 32 seal what the dialer sends, the
  last 32 what the answerer sends.

From then on every message is sealed with ChaCha20-Poly1305 (RFC 8439; the native library's
Monocypher, ``dgr_link_seal``): the header in the clear as associated data, the payload
encrypted, a 16-byte tag after it, the nonce the message's number on its direction. So a frame
from anyone but the connection's peer, or replayed, reordered, dropped or moved to another
connection or epoch, fails its tag (``DGR_E_UNAUTHENTICATED``), and the bytes are private. The
link's own threads seal and open in C; a client's Python side uses :class:`Sealing`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import attrs

from dgr_engine._binding import ffi, lib
from dgr_engine.errors import GrantUnauthenticated
from dgr_engine.status import error_for_code
from dgr_engine.wire.link_messages import HEADER, Hello, Role

__all__ = [
    "KEY_BYTES",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "TAG_BYTES",
    "ConnectionKeys",
    "Dialer",
    "Sealing",
    "answer_hello",
]

KEY_BYTES = int(lib.DGR_LINK_KEY_BYTES)
TAG_BYTES = int(lib.DGR_LINK_TAG_BYTES)
NONCE_BYTES = 16
PROOF_BYTES = 32
_TRANSCRIPT = struct.Struct("<cBQIH")
"""role, ring flag, epoch, hop, session id bytes (then those, then the dialer's nonce)."""


def _mac(secret: bytes, person: bytes, data: bytes, size: int = PROOF_BYTES) -> bytes:
    if not secret:
        raise GrantUnauthenticated("DGR_E_UNAUTHENTICATED: a sealed link needs a session secret")
    return hashlib.blake2b(data, digest_size=size, key=secret[:64], person=person).digest()


def _transcript(
    role: Role, session_id: str, epoch: int, hop: int, ring: bool, nonce: bytes
) -> bytes:
    sid = session_id.encode()
    return _TRANSCRIPT.pack(role.value, int(ring), epoch, hop, len(sid)) + sid + nonce


@attrs.frozen(repr=False)
class ConnectionKeys:
    """One connection's keys, from one side: what it seals with, what it opens with."""

    send: bytes
    receive: bytes


def _keys(secret: bytes, transcript: bytes, answer_nonce: bytes) -> tuple[bytes, bytes]:
    both = _mac(secret, b"dgr-link-keys", transcript + answer_nonce, 2 * KEY_BYTES)
    return both[:KEY_BYTES], both[KEY_BYTES:]


class Dialer:
    """The connecting side of a sealed connection: its ``hello``, then its keys from the
    answer (``keys``)."""

    def __init__(
        self,
        role: Role,
        session_id: str,
        epoch: int,
        secret: bytes,
        hop: int,
        *,
        ring: bool = False,
    ) -> None:
        self._secret = bytes(secret)
        nonce = os.urandom(NONCE_BYTES)
        self._transcript = _transcript(role, session_id, epoch, hop, ring, nonce)
        proof = _mac(self._secret, b"dgr-link-dialer", self._transcript)
        self.hello = Hello(role, session_id, epoch, nonce + proof, hop, ring, sealed=True)

    def keys(self, answer: bytes) -> ConnectionKeys:
        """The connection's keys, once the answer's proof shows the answerer holds the secret;
        ``GrantUnauthenticated`` otherwise."""
        if len(answer) != NONCE_BYTES + PROOF_BYTES:
            raise GrantUnauthenticated(
                "DGR_E_UNAUTHENTICATED: the native link's answer carries no proof of the secret"
            )
        nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        expected = _mac(self._secret, b"dgr-link-answer", self._transcript + nonce)
        if not hmac.compare_digest(expected, proof):
            raise GrantUnauthenticated(
                "DGR_E_UNAUTHENTICATED: the native link's answer does not prove the session secret"
            )
        send, receive = _keys(self._secret, self._transcript, nonce)
        return ConnectionKeys(send, receive)


def answer_hello(hello: Hello, secret: bytes | None) -> tuple[bytes, ConnectionKeys]:
    """The answering side: checks a sealed ``hello``'s proof against the session ``secret``
    (constant time; ``GrantUnauthenticated`` unless it holds, or with no secret) and gives the
    answer's payload and the connection's keys."""
    if not hello.sealed or len(hello.secret) != NONCE_BYTES + PROOF_BYTES or not secret:
        raise GrantUnauthenticated(
            f"DGR_E_UNAUTHENTICATED: session {hello.session_id!r} epoch {hello.epoch}: a sealed "
            "link's introduction without its proof of the session secret"
        )
    nonce, proof = hello.secret[:NONCE_BYTES], hello.secret[NONCE_BYTES:]
    transcript = _transcript(
        hello.role, hello.session_id, hello.epoch, hello.hop, hello.ring, nonce
    )
    if not hmac.compare_digest(_mac(secret, b"dgr-link-dialer", transcript), proof):
        raise GrantUnauthenticated(
            f"DGR_E_UNAUTHENTICATED: session {hello.session_id!r} epoch {hello.epoch}: no or the "
            "wrong session secret"
        )
    mine = os.urandom(NONCE_BYTES)
    answer = mine + _mac(secret, b"dgr-link-answer", transcript + mine)
    to_answerer, to_dialer = _keys(secret, transcript, mine)
    return answer, ConnectionKeys(send=to_dialer, receive=to_answerer)


class Sealing:
    """One direction of a sealed connection, in Python (a client's side of a link): seals the
    messages it sends, or opens the ones it reads, counting them."""

    tag_bytes = TAG_BYTES

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a link key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = ffi.new("uint8_t[]", key)
        self.count = 0
        """Messages sealed or opened so far: the next one's number."""

    def seal(self, message: bytes) -> bytes:
        """A whole message (header and payload) as it goes on the wire: the header, the payload
        encrypted, its tag."""
        head, body = message[: HEADER.size], bytearray(message[HEADER.size :])
        tag = ffi.new("uint8_t[]", TAG_BYTES)
        text = ffi.from_buffer(body) if body else ffi.NULL
        lib.dgr_link_seal(self._key, self.count, head, len(head), text, len(body), tag)
        self.count += 1
        return head + bytes(body) + bytes(ffi.buffer(tag))

    def open(self, head: bytes, body: bytes) -> bytes:
        """The payload of the message whose header is ``head`` and whose payload and tag are
        ``body``; ``GrantUnauthenticated`` (nothing counted) when its tag does not verify."""
        if len(body) < TAG_BYTES:
            raise GrantUnauthenticated("DGR_E_UNAUTHENTICATED: a sealed message without its tag")
        payload = bytearray(body[:-TAG_BYTES])
        text = ffi.from_buffer(payload) if payload else ffi.NULL
        rc = lib.dgr_link_unseal(
            self._key, self.count, head, len(head), text, len(payload), body[-TAG_BYTES:]
        )
        if rc != int(lib.DGR_OK):
            raise error_for_code(rc, ffi.string(lib.dgr_last_error()).decode(errors="replace"))
        self.count += 1
        return bytes(payload)
