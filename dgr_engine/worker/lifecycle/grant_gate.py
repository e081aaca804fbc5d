"""A worker's door for sessions: with grant keys, an open needs a route grant for exactly that
session, epoch and stage (``dgr_engine.security.grants``); with or without them, the open returns a
fresh random session secret, which every later frame, close, ``Link`` and ``ChainOutput`` of
that epoch must carry (compared in constant time; no signature check per frame), so no client
can touch a session another client opened. The gate forgets an epoch's secret when the session
table says it closed that epoch (``worker/lifecycle/closes.py``), or when a newer epoch opens.

Without grant keys a request that names no session held here, or another epoch of it, passes
the door and is refused by the session table as before (unknown session, stale epoch): it
touches nothing. Every request that could touch the held epoch (a frame, link or output of
that epoch; a close of that epoch or a newer one, which would close it) needs its secret. With
grant keys every such request needs the secret of exactly its epoch.
"""

from __future__ import annotations

import hmac
import secrets

import attrs

from dgr_engine.errors import GrantDenied, GrantUnauthenticated, StaleEpoch
from dgr_engine.security.grants import Grant, GrantVerifier
from dgr_engine.worker.lifecycle.closes import SessionClosed

SECRET_BYTES = 16


@attrs.frozen
class _Held:
    epoch: int
    secret: bytes = attrs.field(repr=lambda b: b[:4].hex() + "…")
    grant: Grant | None
    """The grant the epoch was opened with (``None`` without grant keys)."""


class GrantGate:
    """Grants at open, session secrets after; a close listener of the session table (the
    secret of an epoch closed is dropped)."""

    def __init__(self, verifier: GrantVerifier | None) -> None:
        self.verifier = verifier
        self._held: dict[str, _Held] = {}
        # an entry goes when the session table closes its epoch (session_closed), or is
        # replaced by a newer epoch's (opened)
        self._grants: dict[tuple[str, int], Grant] = {}
        # grants admitted whose open has not answered yet (admit -> opened / refund)

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
        grant = self.verifier.verify(
            token,
            session_id=session_id,
            epoch=epoch,
            endpoint=endpoint,
            layers=layers,
            model_sha256=model_sha256,
            lane_id=lane_id,
        )
        self._grants[session_id, epoch] = grant
        return grant

    def refund(self, grant: Grant | None) -> None:
        """The open failed (busy, refused): its grant may be used again."""
        if grant is not None and self.verifier is not None:
            self._grants.pop((grant.session_id, grant.epoch), None)
            self.verifier.refund(grant)

    def opened(self, session_id: str, epoch: int) -> bytes:
        """After an open: the epoch's new secret (with or without grant keys)."""
        secret = secrets.token_bytes(SECRET_BYTES)
        grant = self._grants.pop((session_id, epoch), None)
        self._held[session_id] = _Held(epoch, secret, grant)
        return secret

    def _current(self, session_id: str) -> _Held | None:
        return self._held.get(session_id)

    def held_epoch(self, session_id: str) -> int | None:
        """The epoch of ``session_id`` held here (``None``: none is)."""
        held = self._current(session_id)
        return None if held is None else held.epoch

    def secret_of(self, session_id: str, epoch: int) -> bytes | None:
        """The secret the open of ``(session_id, epoch)`` returned, while that epoch is held
        here (a sealed native link's introduction proves it: ``wire/link_seal.py``)."""
        held = self._current(session_id)
        return held.secret if held is not None and held.epoch == epoch else None

    def knows(self, session_id: str, epoch: int, secret: bytes) -> bool:
        """Whether ``secret`` is the one the open of the held ``(session_id, epoch)`` returned
        (constant time)."""
        held = self._current(session_id)
        expected = held.secret if held is not None else b"\0" * SECRET_BYTES
        return (
            hmac.compare_digest(expected, bytes(secret))
            and held is not None
            and held.epoch == epoch
        )

    def check(self, session_id: str, epoch: int, secret: bytes, *, close: bool = False) -> None:
        """Before a frame, link, output stream or (``close``) a close: ``GrantUnauthenticated``
        unless ``secret`` is the one the open of the held epoch returned (see the module's
        doc for the requests that need none)."""
        held = self._current(session_id)
        if self.verifier is None:
            touches = held is not None and (held.epoch <= epoch if close else held.epoch == epoch)
            if not touches:
                return  # nothing of this session held here, or another epoch: the table refuses
        expected = held.secret if held is not None else b"\0" * SECRET_BYTES
        matches = hmac.compare_digest(expected, bytes(secret))
        if not matches or held is None or (self.verifier is not None and held.epoch != epoch):
            raise GrantUnauthenticated(
                f"DGR_E_UNAUTHENTICATED: session {session_id!r} epoch {epoch}: no or the wrong "
                "session secret"
            )

    def check_held(self, session_id: str, epoch: int, secret: bytes) -> None:
        """``GrantUnauthenticated`` unless the session is held here at ``epoch`` with
        ``secret`` (with or without grant keys): a stage asking before it links to this one.
        ``StaleEpoch`` when a newer epoch is held (as a frame of ``epoch`` would be refused:
        the asking stage links, and this stage's fence refuses the frames, naming itself)."""
        held = self._current(session_id)
        if held is not None and held.epoch > epoch:
            raise StaleEpoch(
                f"DGR_E_STALE_EPOCH: session {session_id!r} epoch {epoch} is older than the "
                f"open epoch {held.epoch}",
                session_id=session_id,
                epoch=epoch,
                held_epoch=held.epoch,
            )
        expected = held.secret if held is not None else b"\0" * SECRET_BYTES
        if not hmac.compare_digest(expected, bytes(secret)) or held is None or held.epoch != epoch:
            raise GrantUnauthenticated(
                f"DGR_E_UNAUTHENTICATED: session {session_id!r} epoch {epoch} is not held here "
                "with that session secret"
            )

    def check_link(self, session_id: str, epoch: int, endpoint: str) -> None:
        """Before ``Link`` (its secret checked already), with grant keys: ``GrantDenied``
        unless ``endpoint`` is the next stage the epoch's grant names."""
        if self.verifier is None:
            return
        held = self._current(session_id)
        granted = held.grant.next_endpoint if held is not None and held.grant else ""
        if not granted or granted != endpoint:
            names = f"next stage {granted!r}" if granted else "no next stage"
            raise GrantDenied(
                f"DGR_E_PERMISSION: session {session_id!r} epoch {epoch}: the route grant names "
                f"{names}, not {endpoint!r}"
            )

    def closed(self, session_id: str, epoch: int) -> None:
        """``(session_id, epoch)`` (or an older epoch of it) is closed here: its secret goes."""
        held = self._held.get(session_id)
        if held is not None and held.epoch <= epoch:
            del self._held[session_id]

    def session_closed(self, closed: SessionClosed) -> None:
        """The session table closed an epoch: as :meth:`closed`, unless a newer epoch's open
        discarded it (that open's :meth:`opened` replaces its secret, as it always did)."""
        if not closed.still_held:
            self.closed(closed.session_id, closed.epoch)
