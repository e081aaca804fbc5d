"""Route grants: the tracker's signed permission for one client session to use one stage.

The tracker (not dgr) holds an Ed25519 signing key; a worker holds its public key(s), each
with an id, so keys can be rotated. A grant binds the session id, the epoch, the stage (its
endpoint as the route names it and its layer range), the model identity and the lane, an expiry
and a nonce. Its token is ``base64url(payload) "." base64url(signature)``, the payload being
canonical JSON (sorted keys, no whitespace).

A worker refuses an open without a valid grant for exactly that session, epoch and stage:
``GrantUnauthenticated`` (gRPC ``UNAUTHENTICATED``) for a missing, malformed or badly signed one
or an unknown key id; ``GrantDenied`` (``PERMISSION_DENIED``) for a valid grant of another
session, epoch, stage, model or lane, an expired one, or one used before (each nonce opens once).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dgr_engine.errors import GrantDenied, GrantUnauthenticated
from dgr_session.route import Route

MAX_TOKEN_BYTES = 4096
_MALFORMED = "DGR_E_UNAUTHENTICATED: the route grant is malformed"


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _unb64(data: bytes) -> bytes:
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


@attrs.frozen
class Grant:
    """What a grant permits."""

    session_id: str
    epoch: int
    endpoint: str
    """The stage's endpoint as the route names it (``host:port``)."""
    layer_begin: int
    layer_end: int
    model_sha256: str
    """Hex content hash of the model identity."""
    lane_id: str
    expires_at: float
    """Unix time after which the grant opens nothing."""
    key_id: str
    nonce: str = attrs.field(factory=lambda: secrets.token_hex(16))

    def payload(self) -> bytes:
        return json.dumps(attrs.asdict(self), sort_keys=True, separators=(",", ":")).encode()


def issue(grant: Grant, key: Ed25519PrivateKey) -> bytes:
    """The signed token of ``grant`` (the tracker's side)."""
    payload = grant.payload()
    return _b64(payload) + b"." + _b64(key.sign(payload))


def _parse(token: bytes) -> tuple[bytes, bytes, dict[str, Any]]:
    if not token:
        raise GrantUnauthenticated("DGR_E_UNAUTHENTICATED: no route grant (this worker needs one)")
    if len(token) > MAX_TOKEN_BYTES or token.count(b".") != 1:
        raise GrantUnauthenticated(_MALFORMED)
    head, tail = token.split(b".")
    try:
        payload, signature = _unb64(head), _unb64(tail)
        if _b64(payload) != head or _b64(signature) != tail:  # one encoding per token only
            raise ValueError("not canonical base64")
        fields = json.loads(payload)
    except (binascii.Error, ValueError):
        raise GrantUnauthenticated(_MALFORMED) from None
    if not isinstance(fields, dict):
        raise GrantUnauthenticated(_MALFORMED)
    return payload, signature, fields


class GrantVerifier:
    """Checks grants against the tracker's public keys (by key id); remembers used nonces until
    their grants expire, so a grant opens once."""

    def __init__(
        self, keys: Mapping[str, Ed25519PublicKey], clock: Callable[[], float] = time.time
    ) -> None:
        if not keys:
            raise ValueError("a grant verifier needs at least one key")
        self.keys = dict(keys)
        self._now = clock
        self._used: dict[str, float] = {}

    def verify(
        self,
        token: bytes,
        *,
        session_id: str,
        epoch: int,
        endpoint: str,
        layers: tuple[int, int],
        model_sha256: str,
        lane_id: str,
    ) -> Grant:
        """The grant of ``token`` if it permits exactly this open; raises otherwise. A grant
        that passes is spent."""
        payload, signature, fields = _parse(token)
        key = self.keys.get(str(fields.get("key_id")))
        if key is None:
            raise GrantUnauthenticated(
                "DGR_E_UNAUTHENTICATED: route grant signed by an unknown key "
                f"{fields.get('key_id')!r}"
            )
        try:
            key.verify(signature, payload)
        except InvalidSignature:
            raise GrantUnauthenticated(
                "DGR_E_UNAUTHENTICATED: the route grant's signature does not verify"
            ) from None
        try:
            grant = Grant(**fields)
        except TypeError:
            raise GrantUnauthenticated(_MALFORMED) from None
        wanted = {
            "session": (grant.session_id, session_id),
            "epoch": (grant.epoch, epoch),
            "stage": (grant.endpoint, endpoint),
            "layer range": ((grant.layer_begin, grant.layer_end), tuple(layers)),
            "model": (grant.model_sha256, model_sha256),
            "lane": (grant.lane_id, lane_id),
        }
        for what, (granted, asked) in wanted.items():
            if granted != asked:
                raise GrantDenied(
                    f"DGR_E_PERMISSION: the route grant is for another {what} ({granted!r}, not "
                    f"{asked!r})"
                )
        now = self._now()
        if not grant.expires_at > now:
            raise GrantDenied("DGR_E_PERMISSION: the route grant has expired")
        for nonce in [n for n, until in self._used.items() if until <= now]:
            del self._used[nonce]
        if grant.nonce in self._used:
            raise GrantDenied("DGR_E_PERMISSION: the route grant was used before")
        self._used[grant.nonce] = grant.expires_at
        return grant

    def refund(self, grant: Grant) -> None:
        """``grant`` opened nothing after all (the worker was busy): it may be used again."""
        self._used.pop(grant.nonce, None)


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file; ``ValueError`` naming the file otherwise."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"grant key {path}: not a readable PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"grant key {path}: not an Ed25519 key")
    return key


def public_pem(key: Ed25519PrivateKey) -> bytes:
    """The PEM of ``key``'s public half (what a worker is given)."""
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class GrantIssuer:
    """The tracker's side, for the demo, the example tracker and the tests: signs every stage
    of a route for one session and epoch (``dgr_session.GrantingRouteProvider.grant_route``)."""

    def __init__(
        self,
        key: Ed25519PrivateKey,
        key_id: str,
        *,
        ttl_seconds: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key = key
        self.key_id = key_id
        self.ttl_seconds = ttl_seconds
        self._now = clock

    def grant_route(self, session_id: str, epoch: int, route: Route) -> Route:
        expires = self._now() + self.ttl_seconds
        return Route(
            attrs.evolve(
                stage,
                grant=issue(
                    Grant(
                        session_id=session_id,
                        epoch=epoch,
                        endpoint=stage.endpoint,
                        layer_begin=stage.layer_begin,
                        layer_end=stage.layer_end,
                        model_sha256=stage.identity.content_hash.hex(),
                        lane_id=stage.lane.lane_id,
                        expires_at=expires,
                        key_id=self.key_id,
                    ),
                    self.key,
                ),
            )
            for stage in route.stages
        )

    def worker_args(self, directory: str | os.PathLike[str]) -> list[str]:
        """``dgr worker`` arguments that make a worker check this issuer's grants (its public
        key written to ``directory``)."""
        path = Path(directory) / f"grant-key-{self.key_id}.pem"
        path.write_bytes(public_pem(self.key))
        return ["--grant-key", f"{self.key_id}={path}"]
