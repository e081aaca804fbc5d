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

Replay across a restart: a grant names when it was issued (``issued_at``, signed), and a
verifier refuses every grant issued before the verifier itself was made, that is before this
instance of the worker started. A restarted worker has forgotten the nonces its previous
instance spent, but every grant that instance could have spent was issued before the restart,
so none opens again. Why this and not a durable replay cache: it needs no state on disk that
could be lost, copied or shared between workers, and a worker that restarted holds no session
anyway (its KV is gone), so its clients open a new epoch with fresh grants. It assumes the
tracker's clock and the worker's agree to within the time between issuing and using a grant
(expiry assumes as much). A grant also names the stage its stage's output may go to on a
chained route (``next_endpoint``; the first stage for the last one, a ring): ``Chain.Link``
dials nothing else.
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
    issued_at: float = attrs.field(factory=time.time)
    """Unix time the tracker signed it; a worker that started later refuses it (a restarted
    worker cannot know whether its previous instance spent it)."""
    next_endpoint: str = ""
    """The endpoint this stage's output may be sent to on a chained route (the route's next
    stage; for the last stage, the first: a ring); ``""``: none (``Chain.Link`` is refused)."""

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
        self,
        keys: Mapping[str, Ed25519PublicKey],
        clock: Callable[[], float] = time.time,
        *,
        started_at: float | None = None,
    ) -> None:
        if not keys:
            raise ValueError("a grant verifier needs at least one key")
        self.keys = dict(keys)
        self._now = clock
        self._used: dict[str, float] = {}
        self.started_at = clock() if started_at is None else started_at
        """Grants issued before this (the worker's start) open nothing: the nonces a previous
        instance spent are not known here."""

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
        grant = self.signed(token)
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
        if grant.issued_at < self.started_at:
            raise GrantDenied(
                "DGR_E_PERMISSION: the route grant was issued before this worker started "
                "(a restarted worker cannot tell whether it was used before): ask for a fresh one"
            )
        for nonce in [n for n, until in self._used.items() if until <= now]:
            del self._used[nonce]
        if grant.nonce in self._used:
            raise GrantDenied("DGR_E_PERMISSION: the route grant was used before")
        self._used[grant.nonce] = grant.expires_at
        return grant

    def signed(self, token: bytes) -> Grant:
        """The grant of ``token`` if a known key signed it (whatever it permits); raises
        ``GrantUnauthenticated`` otherwise. Spends nothing."""
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
        if not isinstance(fields.get("issued_at"), int | float):  # an issuer older than this
            raise GrantUnauthenticated(_MALFORMED + " (no issue time)")
        try:
            return Grant(**fields)
        except TypeError:
            raise GrantUnauthenticated(_MALFORMED) from None

    def permits_usage(self, token: bytes, *, session_id: str, endpoint: str) -> bool:
        """Whether ``token`` is the tracker's credential for reading the usage of
        ``session_id`` on this stage: a grant a known key signed, unexpired, for that session
        and stage endpoint (any epoch; nothing spent)."""
        try:
            grant = self.signed(token)
        except GrantUnauthenticated:
            return False
        return (
            grant.session_id == session_id
            and grant.endpoint == endpoint
            and grant.expires_at > self._now()
        )

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
        """``route`` with each stage's grant: for that stage, naming the next stage as where
        its output may go (the first stage for the last: a ring may link back)."""
        now = self._now()
        stages = route.stages
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
                        expires_at=now + self.ttl_seconds,
                        key_id=self.key_id,
                        issued_at=now,
                        next_endpoint=stages[(index + 1) % len(stages)].endpoint,
                    ),
                    self.key,
                ),
            )
            for index, stage in enumerate(stages)
        )

    def usage_grant(self, session_id: str, endpoint: str) -> bytes:
        """The tracker's credential for a worker's ``Usage`` of ``session_id`` at
        ``endpoint`` (a grant that opens nothing: no layers, model or lane)."""
        now = self._now()
        grant = Grant(
            session_id=session_id,
            epoch=0,
            endpoint=endpoint,
            layer_begin=0,
            layer_end=0,
            model_sha256="",
            lane_id="",
            expires_at=now + self.ttl_seconds,
            key_id=self.key_id,
            issued_at=now,
        )
        return issue(grant, self.key)

    def worker_args(self, directory: str | os.PathLike[str]) -> list[str]:
        """``dgr worker`` arguments that make a worker check this issuer's grants (its public
        key written to ``directory``)."""
        path = Path(directory) / f"grant-key-{self.key_id}.pem"
        path.write_bytes(public_pem(self.key))
        return ["--grant-key", f"{self.key_id}={path}"]
