"""A worker's door for route grants: an open needs a grant for exactly that session, epoch and
stage (``dgr_engine.grants``); the open returns a random session secret, which every later frame
and the close of that epoch must carry (compared in constant time; no signature check per
frame). Without grant keys the door is open and secrets are empty."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

from dgr_engine.errors import GrantUnauthenticated
from dgr_engine.grants import Grant, GrantVerifier

SECRET_BYTES = 16


class GrantGate:
    """Grants at open, session secrets after. ``holds(session_id)``: the worker still holds the
    session (secrets of sessions gone are dropped)."""

    def __init__(self, verifier: GrantVerifier | None, holds: Callable[[str], bool]) -> None:
        self.verifier = verifier
        self._holds = holds
        self._secrets: dict[str, tuple[int, bytes]] = {}

    @property
    def enabled(self) -> bool:
        return self.verifier is not None

    def admit(
        self,
        token: bytes,
        *,
        session_id: str,
        epoch: int,
        endpoint: str,
        layers: tuple[int, int],
        model_sha256: str,
        lane_id: str,
    ) -> Grant | None:
        """Before an open: the grant that permits it (spent), or ``None`` without grant keys;
        raises ``GrantUnauthenticated`` / ``GrantDenied`` otherwise."""
        if self.verifier is None:
            return None
        return self.verifier.verify(
            token,
            session_id=session_id,
            epoch=epoch,
            endpoint=endpoint,
            layers=layers,
            model_sha256=model_sha256,
            lane_id=lane_id,
        )

    def refund(self, grant: Grant | None) -> None:
        """The open failed (busy, refused): its grant may be used again."""
        if grant is not None and self.verifier is not None:
            self.verifier.refund(grant)

    def opened(self, session_id: str, epoch: int) -> bytes:
        """After an open: the epoch's new secret (empty without grant keys)."""
        if self.verifier is None:
            return b""
        for gone in [s for s in self._secrets if not self._holds(s)]:
            del self._secrets[gone]
        secret = secrets.token_bytes(SECRET_BYTES)
        self._secrets[session_id] = (epoch, secret)
        return secret

    def check(self, session_id: str, epoch: int, secret: bytes) -> None:
        """Before a frame or a close: ``GrantUnauthenticated`` unless ``secret`` is the one the
        open of this epoch returned."""
        if self.verifier is None:
            return
        held = self._secrets.get(session_id)
        expected = held[1] if held is not None and held[0] == epoch else b"\0" * SECRET_BYTES
        if not hmac.compare_digest(expected, bytes(secret)) or held is None or held[0] != epoch:
            raise GrantUnauthenticated(
                f"DGR_E_UNAUTHENTICATED: session {session_id!r} epoch {epoch}: no or the wrong "
                "session secret"
            )

    def closed(self, session_id: str, epoch: int) -> None:
        held = self._secrets.get(session_id)
        if held is not None and held[0] <= epoch:
            del self._secrets[session_id]
