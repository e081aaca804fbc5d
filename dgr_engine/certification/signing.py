"""Certifier signatures on evidence records (Ed25519, as route grants are signed).

A record's id is the SHA-256 of its canonical content; a certifier signs that id (with a
domain prefix, so the signature means nothing elsewhere). Anybody can recompute an id, so the
id alone proves nothing: the loader admits a record only when its signature verifies under a
certifier public key the lock declares for the record's evidence class
(:meth:`~dgr_engine.certification.lock.Lock.check_signature`).

A key's id is its fingerprint, ``ed25519:`` and the first 16 bytes (hex) of the SHA-256 of its
raw public bytes: derived from the key, so a record cannot name one key and carry another's
signature.

:data:`FIXTURE_CERTIFIER` is a key whose private half is deliberately public (it is derived
from the text below): it lets ``dgr certify``, ``dgr demo`` and the tests sign fixture records on
any machine. It is worthless beyond fixture evidence, and the lock refuses to trust it for any
other class. Real-model, real-hardware and release records need the operator's own key
(``dgr certify --sign-key FILE``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_CONTEXT = b"dgr.evidence-signature/1\n"
"""What a certifier signs is this prefix and the record id (hex, ASCII)."""

FIXTURE_CERTIFIER_SEED_TEXT = (
    b"dgr fixture certifier: this private key is public; it signs fixture evidence only"
)
"""The fixture certifier's private key is the SHA-256 of this text: anybody can sign with it."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    data = text.encode("ascii")
    raw = base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))
    if _b64(raw) != text:  # one encoding per value only
        raise ValueError("not canonical base64url")
    return raw


def raw_public(key: Ed25519PublicKey) -> bytes:
    """The key's 32 raw bytes."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id_of(key: Ed25519PublicKey) -> str:
    """The key's fingerprint: ``ed25519:`` + 32 hex digits."""
    return "ed25519:" + hashlib.sha256(raw_public(key)).hexdigest()[:32]


def public_key_text(key: Ed25519PublicKey) -> str:
    """The public key as the lock declares it (base64url of the raw bytes, no padding)."""
    return _b64(raw_public(key))


def parse_public_key(text: str) -> Ed25519PublicKey:
    """The key a lock declares; ``ValueError`` when ``text`` is not one."""
    try:
        raw = _unb64(text)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ValueError("not base64url") from None
    if len(raw) != 32:
        raise ValueError(f"{len(raw)} bytes, an Ed25519 public key has 32")
    return Ed25519PublicKey.from_public_bytes(raw)


FIXTURE_CERTIFIER = Ed25519PrivateKey.from_private_bytes(
    hashlib.sha256(FIXTURE_CERTIFIER_SEED_TEXT).digest()
)
"""The fixture certifier (private half public: see the module's docstring)."""
FIXTURE_CERTIFIER_ID = key_id_of(FIXTURE_CERTIFIER.public_key())


@attrs.frozen
class RecordSignature:
    """A certifier's signature on a record id."""

    key_id: str
    """The signing key's fingerprint (:func:`key_id_of`)."""
    value: str
    """The Ed25519 signature, base64url without padding."""

    def verifies(self, key: Ed25519PublicKey, record_id: str) -> bool:
        """Whether this is ``key``'s signature of ``record_id``."""
        try:
            key.verify(_unb64(self.value), SIGNATURE_CONTEXT + record_id.encode("ascii"))
        except (InvalidSignature, binascii.Error, ValueError, UnicodeEncodeError):
            return False
        return True


def sign(record_id: str, key: Ed25519PrivateKey) -> RecordSignature:
    """``key``'s signature of ``record_id``."""
    value = key.sign(SIGNATURE_CONTEXT + record_id.encode("ascii"))
    return RecordSignature(key_id=key_id_of(key.public_key()), value=_b64(value))


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An Ed25519 private key from an unencrypted PEM (PKCS#8) file, as ``openssl genpkey
    -algorithm ed25519`` writes it; ``ValueError`` naming the file otherwise (one line)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"signing key {path}: cannot read ({exc.strerror})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"signing key {path}: not an unencrypted PEM private key ({reason})"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"signing key {path}: not an Ed25519 key")
    return key


def private_pem(key: Ed25519PrivateKey) -> bytes:
    """``key`` as an unencrypted PKCS#8 PEM (what ``--sign-key`` reads)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
