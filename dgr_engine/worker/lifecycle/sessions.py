"""The worker's session table: wire session ids over one engine's session keys, with each
session's epoch, next position and last use mirrored for ``Describe`` and the lease sweeper.

Every method but :meth:`SessionTable.snapshot`, :meth:`SessionTable.oldest_use`,
:meth:`SessionTable.holds` and :meth:`SessionTable.check_open` runs on the engine thread;
``_lock`` only guards the dict against a concurrent reader (invariant: an entry exists iff its
engine session is open).

The table publishes every close it makes, whatever its cause, to the listeners it was built
with (``worker/lifecycle/closes.py``): after the engine closed the session and the entry is
gone, outside ``_lock``, each listener told in turn, one that raises logged and skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import attrs
import numpy as np
from loguru import logger

from dgr_engine.engine import FloatArray, ForwardItem, ShardInfo
from dgr_engine.engine.sampling import sample_rows
from dgr_engine.errors import (
    EngineError,
    FrameRejected,
    NonFiniteOutput,
    StaleEpoch,
    UnknownSession,
    UnsupportedFeature,
)
from dgr_engine.numerics import Numerics
from dgr_engine.wire.frames import FloatRows, ForwardFrame
from dgr_engine.worker.lifecycle.closes import CloseCause, CloseListener, SessionClosed, notify
from dgr_engine.worker.lifecycle.tombstones import Tombstones
from dgr_session.sampling import GREEDY, Sampling
from dgr_session.speculation import kept_drafts

if TYPE_CHECKING:
    from loguru import Logger


class EngineLike(Protocol):
    """What the worker needs of a ``ShardEngine`` (which is the only production engine)."""

    info: ShardInfo
    numerics: Numerics

    def open_session(self, session_id: int, epoch: int) -> None: ...
    def close_session(self, session_id: int, epoch: int) -> None: ...
    def forward(
        self,
        session_id: int,
        epoch: int,
        positions: np.ndarray,
        *,
        tokens: np.ndarray | None = None,
        rows: np.ndarray | None = None,
        want: np.ndarray | None = None,
    ) -> FloatArray: ...
    def forward_batch(self, items: Sequence[ForwardItem]) -> list[FloatArray | EngineError]: ...
    def truncate(self, session_id: int, epoch: int, n_keep: int) -> None: ...
    def save_state(self, session_id: int, epoch: int) -> bytes: ...
    def load_state(self, session_id: int, epoch: int, state: bytes) -> None: ...
    def close(self) -> None: ...


class MtpEngine(Protocol):
    """An engine that loaded the MTP block (``ShardEngine(load_mtp=True)``)."""

    def mtp_draft(
        self, session_id: int, epoch: int, last_token: int, k: int, *, n_keep: int | None = None
    ) -> list[int]: ...


@attrs.define
class _Entry:
    key: int
    epoch: int
    last_used: float
    next_pos: int = 0
    verify: tuple[int, int] | None = None
    """The last frame was a verification pass: (its first draft's position, its drafts)."""
    mtp_drafts: tuple[int, tuple[int, ...]] | None = None
    """The MTP drafts the last frame asked for (``mtp_draft_max``): (the position of the token
    they follow, the drafts); taken by the frame's reply (:meth:`SessionTable.take_mtp_drafts`)."""
    sampling: Sampling = GREEDY
    """The session's sampler (its open's), which a last stage applies (``docs/sampling.md``)."""
    history: list[int] = attrs.Factory(list)
    """A penalised sampler's last stage: the token at every position the session ran here."""


class Ran(NamedTuple):
    """What a frame's run gives: its output rows, the session's next position and, on a last
    stage, the session's token of each logits row (its sampler's: ``docs/sampling.md``)."""

    rows: FloatRows
    next_pos: int
    sampled: tuple[int, ...] | None = None
    """``None``: not a last stage, or no logits rows."""


@attrs.define
class LeaseSweep:
    """What :meth:`SessionTable.expire_idle` did."""

    closed: list[tuple[str, int]] = attrs.Factory(list)
    """``(session_id, epoch)`` of the sessions closed."""
    failed: list[tuple[str, int, EngineError]] = attrs.Factory(list)
    """Sessions whose engine close failed (still open), with the error."""


@attrs.frozen
class TableSnapshot:
    sessions_open: int
    kv_tokens_used: int


class SessionTable:
    """Sessions of one engine, by wire id. ``clock`` (seconds, monotonic) times their use."""

    def __init__(
        self,
        engine: EngineLike,
        clock: Callable[[], float] = time.monotonic,
        *,
        tombstone_seconds: float = 600.0,
        listeners: Sequence[CloseListener] = (),
        log: Logger | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self._listeners = tuple(listeners)
        """Told of every close (``worker/lifecycle/closes.py``), in this order."""
        self._log = log if log is not None else logger
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._keys = itertools.count(1)
        self._tombstones = Tombstones(clock, tombstone_seconds)
        """Closes that found nothing of their epoch, kept ``tombstone_seconds``: the opens they
        overtook are refused when they arrive (``worker/lifecycle/tombstones.py``)."""

    def open(self, session_id: str, epoch: int, sampling: Sampling = GREEDY) -> bool:
        """Opens ``(session_id, epoch)`` with the session's sampler (``sampling``, which a last
        stage applies); True if an older epoch's state was discarded. Refused as stale when a
        close of this epoch (or a newer one) came first and found nothing."""
        if self._tombstones.blocks(session_id, epoch):
            raise StaleEpoch(
                f"DGR_E_STALE_EPOCH: session {session_id!r} epoch {epoch} was closed by its "
                "client before this open arrived: not opened",
                session_id=session_id,
                epoch=epoch,
            )
        entry = self._entries.get(session_id)
        if entry is not None and epoch < entry.epoch:
            raise self._stale(session_id, epoch, entry)
        key = entry.key if entry is not None else next(self._keys)
        with _naming(session_id, key):
            self.engine.open_session(key, epoch)
        discarded = entry is not None and epoch > entry.epoch
        if entry is None or discarded:
            with self._lock:
                self._entries[session_id] = _Entry(key, epoch, self.clock(), sampling=sampling)
        else:  # the same epoch again: it starts over
            entry.last_used = self.clock()
            entry.sampling, entry.history = sampling, []
        if entry is not None and discarded:  # the older epoch's state is gone
            self._publish(session_id, entry.epoch, CloseCause.SUPERSEDED)
        return discarded

    @property
    def native_ns(self) -> int:
        """Nanoseconds the engine has spent inside llama.cpp (``ShardEngine.native_ns``; 0 for
        an engine that does not say)."""
        return int(getattr(self.engine, "native_ns", 0))

    def forward(self, frame: ForwardFrame) -> Ran:
        """Runs the frame; returns the output rows and the session's next position."""
        entry = self._live(frame.session_id, frame.epoch)
        try:
            with _naming(frame.session_id, entry.key):
                self._check_mtp(frame)
                self._check_history(frame, entry)
                self._keep_drafts(frame, entry)
                out = self.engine.forward(
                    entry.key,
                    frame.epoch,
                    frame.positions,
                    tokens=frame.tokens,
                    rows=frame.rows,
                    want=frame.want,
                )
        finally:
            entry.last_used = self.clock()  # a refused frame still shows the client is there
        return self._finish(frame, entry, out)

    def forward_batch(self, frames: Sequence[ForwardFrame]) -> list[Ran | Exception]:
        """Runs frames of distinct sessions in one engine call (co-batching); each frame's
        result is what :meth:`forward` would return or raise for it alone, in frame order."""
        results: list[Ran | Exception | None] = [None] * len(frames)
        live: list[tuple[int, _Entry]] = []
        for index, frame in enumerate(frames):
            try:
                entry = self._live(frame.session_id, frame.epoch)
                with _naming(frame.session_id, entry.key):
                    self._check_mtp(frame)
                    self._check_history(frame, entry)
                    self._keep_drafts(frame, entry)
                live.append((index, entry))
            except EngineError as exc:
                results[index] = exc
        items = [
            ForwardItem(
                entry.key,
                frames[index].epoch,
                frames[index].positions,
                tokens=frames[index].tokens,
                rows=frames[index].rows,
                want=frames[index].want,
            )
            for index, entry in live
        ]
        outs = self.engine.forward_batch(items) if items else []
        for (index, entry), out in zip(live, outs, strict=True):
            frame = frames[index]
            entry.last_used = self.clock()
            if isinstance(out, EngineError):
                results[index] = _named(out, frame.session_id, entry.key)
                continue
            try:
                results[index] = self._finish(frame, entry, out)
            except NonFiniteOutput as exc:
                results[index] = exc
        return [result for result in results if result is not None]

    def _finish(self, frame: ForwardFrame, entry: _Entry, out: FloatRows) -> Ran:
        """After the engine ran ``frame``: refuses (and closes) output that is not finite, else
        advances the mirrored position."""
        if not np.isfinite(out).all():  # its KV holds them too: nobody may continue it
            self.close(frame.session_id, frame.epoch, CloseCause.NON_FINITE)
            raise NonFiniteOutput(
                f"DGR_E_NON_FINITE: the engine produced NaN or infinity for session "
                f"{frame.session_id!r} epoch {frame.epoch}; the session was closed"
            )
        entry.next_pos = int(frame.positions[-1]) + 1
        if frame.drafts:
            entry.verify = (entry.next_pos - frame.drafts, frame.drafts)
        entry.mtp_drafts = None
        if not self.engine.info.is_last:
            return Ran(out, entry.next_pos)
        if entry.sampling.penalized and frame.sent_ids is not None:
            start = int(frame.positions[0])
            del entry.history[start:]
            entry.history.extend(int(t) for t in frame.sent_ids)
        # the tokens go with the rows (asked for, or for a ring's next frame or the MTP drafts):
        # a close that lands before the reply is sent cannot take them from it
        sampled = self._sample(frame, entry, out) if out.shape[0] else None
        if frame.mtp_draft_max and sampled is not None:
            with _naming(frame.session_id, entry.key):
                entry.mtp_drafts = self._mtp_draft(frame, entry, out, sampled)
        return Ran(out, entry.next_pos, sampled)

    def _check_history(self, frame: ForwardFrame, entry: _Entry) -> None:
        """A penalised sampler's last stage reads the tokens before every position: a frame
        without its token ids is refused before anything changes."""
        if entry.sampling.penalized and self.engine.info.is_last and frame.sent_ids is None:
            raise FrameRejected(
                "DGR_E_FRAME: the session's sampler has penalties, so its last stage needs "
                "every frame's token ids (token_ids): nothing ran"
            )

    def _sample(self, frame: ForwardFrame, entry: _Entry, out: FloatRows) -> tuple[int, ...]:
        """The session's token of each logits row ``out`` holds (the wanted rows, in order):
        its sampler's, at the position after the row's."""
        wanted = frame.positions if frame.want is None else frame.positions[frame.want != 0]
        if frame.want is None:
            wanted = wanted[-1:]
        return tuple(sample_rows(entry.sampling, out, (wanted + 1).tolist(), entry.history))

    def _check_mtp(self, frame: ForwardFrame) -> None:
        """A frame asking for MTP drafts of a last stage without the MTP block is refused
        before anything changes (an earlier stage of a chain only passes the ask on)."""
        mtp = getattr(self.engine, "mtp_loaded", False)
        if frame.mtp_draft_max and self.engine.info.is_last and not mtp:
            raise UnsupportedFeature(
                f"DGR_E_UNSUPPORTED: mtp_draft_max {frame.mtp_draft_max}, but this last stage "
                "did not load the model's MTP block (only a deepseek4 model's last stage with "
                "one does): nothing ran"
            )

    def _mtp_draft(
        self, frame: ForwardFrame, entry: _Entry, out: FloatRows, sampled: tuple[int, ...]
    ) -> tuple[int, tuple[int, ...]] | None:
        """After ``frame`` ran: the token and position the session goes on from (the sampled
        token of the last row; after a pass, the token after the drafts it keeps, as
        ``ring_drafts.RingDrafting.next_tokens``) and the MTP block's drafts to follow it, as
        from that position (the main KV keeps the pass's rows until the next frame's
        ``kept_drafts``). ``None`` when the frame's logits do not tell."""
        n = frame.n_rows
        if not frame.drafts:
            if frame.want is not None and not frame.want[-1]:
                return None
            token, position = sampled[-1], entry.next_pos
        else:
            if out.shape[0] != n or frame.sent_ids is None:
                return None
            base = n - frame.drafts - 1  # the row of the newest token
            kept = kept_drafts(list(sampled[base:]), frame.sent_ids[base + 1 :].tolist())
            token, position = sampled[base + kept], int(frame.positions[base]) + 1 + kept
        engine: MtpEngine = self.engine  # type: ignore[assignment]
        try:
            drafts = engine.mtp_draft(
                entry.key, frame.epoch, token, frame.mtp_draft_max, n_keep=position
            )
        except UnsupportedFeature as exc:  # the frame ran: it only drafts nothing
            self._log.warning("no MTP drafts for {}: {}", frame.session_id, exc)
            return None
        return position, tuple(drafts)

    def take_mtp_drafts(self, session_id: str, epoch: int) -> tuple[int, tuple[int, ...]] | None:
        """The MTP drafts of the session's last frame (position of the token they follow,
        drafts), once; safe from any thread."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.epoch != epoch:
                return None
            held, entry.mtp_drafts = entry.mtp_drafts, None
            return held

    def _keep_drafts(self, frame: ForwardFrame, entry: _Entry) -> None:
        """Before a frame runs: after a verification pass, drops the positions of the drafts
        the session did not keep (``frame.kept_drafts``). A frame that does not match what
        this stage holds (no pass to keep drafts of, more kept than drafted, a pass left
        unanswered, rows that do not start right after the kept drafts) is refused before
        anything changes."""
        verify, kept = entry.verify, frame.kept_drafts
        if verify is None:
            if kept is not None:
                raise FrameRejected(
                    f"DGR_E_FRAME: kept_drafts {kept}, but the session's last frame here was "
                    "no verification pass"
                )
            return
        first, drafts = verify
        if kept is None:
            raise FrameRejected(
                f"DGR_E_FRAME: the session's last frame here verified {drafts} drafts: this "
                "frame must say how many it kept (kept_drafts)"
            )
        if kept > drafts:
            raise FrameRejected(
                f"DGR_E_FRAME: kept_drafts {kept}, but the verification pass held {drafts}"
            )
        start = int(frame.positions[0])
        if start != first + kept:
            raise FrameRejected(
                f"DGR_E_FRAME: after keeping {kept} of {drafts} drafts the session continues "
                f"at position {first + kept}, not {start}"
            )
        if kept < drafts:
            self.engine.truncate(entry.key, frame.epoch, first + kept)
        entry.next_pos = first + kept
        entry.verify = None

    def close(self, session_id: str, epoch: int, cause: CloseCause = CloseCause.CLIENT) -> int:
        """Closes the session if it is open at ``epoch`` or older (a newer epoch was opened
        elsewhere: the state held here is dead); returns the epoch closed. A newer open epoch
        is refused as stale, an unknown session as unknown. A close that finds nothing of its
        epoch (nothing, or an older epoch) leaves a tombstone: that epoch's open may still be on
        its way (in line for a slot, or queued behind a stall), and is refused when it lands.
        ``cause`` is what the listeners are told."""
        entry = self._entries.get(session_id)
        if entry is None or entry.epoch < epoch:
            self._tombstones.record(session_id, epoch)
        if entry is None or epoch < entry.epoch:
            entry = self._live(session_id, epoch)  # raises
        with _naming(session_id, entry.key):
            self.engine.close_session(entry.key, entry.epoch)
        with self._lock:
            del self._entries[session_id]
        self._publish(session_id, entry.epoch, cause)
        return entry.epoch

    # -- kept prefixes (``worker/lifecycle/prefixes.py``, ``docs/prefix-cache.md``) -------------

    @property
    def keeps_prefixes(self) -> bool:
        """Whether sessions of this engine can be kept as prefixes: a dense model's without the
        MTP block (DeepSeek V4's compressed state cannot be cut at any position)."""
        info = self.engine.info
        return info.arch != "deepseek4" and not getattr(self.engine, "mtp_loaded", False)

    def save_prefix(self, session_id: str, epoch: int, length: int) -> bytes | None:
        """The engine state of the open epoch's first ``length`` positions, its KV cut to them
        first (the session is about to close); ``None`` when it holds fewer, ``length`` is
        below 1 or this engine keeps no prefixes."""
        entry = self._entries.get(session_id)
        if entry is None or entry.epoch != epoch or length < 1 or not self.keeps_prefixes:
            return None
        next_pos = getattr(self.engine, "next_pos", None)  # a native link ran it meanwhile
        held = entry.next_pos if next_pos is None else int(next_pos(entry.key, epoch))
        if held < length:
            return None
        with _naming(session_id, entry.key):
            if held > length:
                self.engine.truncate(entry.key, epoch, length)
            entry.next_pos, entry.verify = length, None
            return self.engine.save_state(entry.key, epoch)

    def start_from(self, session_id: str, epoch: int, state: bytes | None, length: int) -> int:
        """Sets the open epoch to exactly the first ``length`` positions of a kept prefix's
        ``state`` (``None`` or ``length`` 0: empty); returns the positions it holds now. A
        penalised sampler's last stage starts empty (it would need the tokens before)."""
        entry = self._live(session_id, epoch)
        penalised = entry.sampling.penalized and self.engine.info.is_last
        with _naming(session_id, entry.key):
            if state is not None and length > 0 and self.keeps_prefixes and not penalised:
                try:
                    self.engine.load_state(entry.key, epoch, state)
                    self.engine.truncate(entry.key, epoch, length)
                except EngineError as exc:  # refused: the session is emptied below
                    self._log.warning("kept prefix not loaded: {}", exc)
                else:
                    entry.next_pos, entry.verify, entry.history = length, None, []
                    return length
            self.engine.truncate(entry.key, epoch, 0)
        entry.next_pos, entry.verify, entry.history = 0, None, []
        return 0

    def holds(self, session_id: str) -> bool:
        """Whether the session is open here (at any epoch); safe from any thread."""
        with self._lock:
            return session_id in self._entries

    def engine_key(self, session_id: str, epoch: int) -> int:
        """The engine's key of ``(session_id, epoch)`` (a native link runs it by that key);
        ``UnknownSession`` / ``StaleEpoch`` unless it is open; safe from any thread."""
        with self._lock:
            return self._live(session_id, epoch).key

    def sampling_of(self, session_id: str, epoch: int) -> Sampling:
        """The sampler ``(session_id, epoch)`` was opened with (a native link's last stage
        applies it); ``UnknownSession`` / ``StaleEpoch`` unless it is open; safe from any
        thread."""
        with self._lock:
            return self._live(session_id, epoch).sampling

    def native_ran(self, session_id: str, epoch: int) -> None:
        """A native link ran frames of ``(session_id, epoch)`` (``docs/native-path.md``): the
        session was used now (its lease and the stall watchdog see it) and its mirrored
        position is the engine's. Nothing when the epoch is no longer open."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.epoch != epoch:
                return
            entry.last_used = self.clock()
            key = entry.key
        next_pos = getattr(self.engine, "next_pos", None)
        if next_pos is not None:
            with contextlib.suppress(EngineError):  # closed meanwhile: nothing to mirror
                entry.next_pos = int(next_pos(key, epoch))

    def check_open(self, session_id: str, epoch: int) -> None:
        """``UnknownSession`` / ``StaleEpoch`` unless ``(session_id, epoch)`` is open here;
        safe from any thread."""
        with self._lock:
            self._live(session_id, epoch)

    def close_all(self) -> int:
        """Closes every session (cause ``SHUTDOWN``); returns how many were open."""
        with self._lock:
            entries = list(self._entries.items())
            self._entries.clear()
        for session_id, entry in entries:
            self.engine.close_session(entry.key, entry.epoch)
            self._publish(session_id, entry.epoch, CloseCause.SHUTDOWN)
        return len(entries)

    def expire_idle(self, lease_seconds: float) -> LeaseSweep:
        """Closes every session unused (not opened or forwarded) for at least
        ``lease_seconds`` (cause ``LEASE``). A session whose engine close fails stays open (and
        listed as failed)."""
        return self.expire_unused_since(self.clock() - lease_seconds, CloseCause.LEASE)

    def expire_unused_since(self, since: float, cause: CloseCause = CloseCause.STALL) -> LeaseSweep:
        """Closes every session last used at or before ``since`` (clock time); as
        :meth:`expire_idle`."""
        with self._lock:
            idle = [(sid, e) for sid, e in self._entries.items() if e.last_used <= since]
        sweep = LeaseSweep()
        for session_id, entry in idle:
            try:
                with _naming(session_id, entry.key):
                    self.engine.close_session(entry.key, entry.epoch)
            except EngineError as exc:
                sweep.failed.append((session_id, entry.epoch, exc))
                continue
            with self._lock:
                del self._entries[session_id]
            sweep.closed.append((session_id, entry.epoch))
            self._publish(session_id, entry.epoch, cause)
        return sweep

    def _publish(self, session_id: str, epoch: int, cause: CloseCause) -> None:
        """Tells the listeners (never under ``_lock``; a listener's failure is logged)."""
        notify(self._listeners, SessionClosed(session_id, epoch, cause), self._log)

    def oldest_use(self) -> float | None:
        """When the least recently used session was last used (``None``: no session open);
        safe from any thread."""
        with self._lock:
            return min((e.last_used for e in self._entries.values()), default=None)

    def snapshot(self) -> TableSnapshot:
        """Counts for the advert (safe from any thread)."""
        with self._lock:
            used = sum(e.next_pos for e in self._entries.values())
            return TableSnapshot(sessions_open=len(self._entries), kv_tokens_used=used)

    def _live(self, session_id: str, epoch: int) -> _Entry:
        entry = self._entries.get(session_id)
        if entry is None:
            raise UnknownSession(f"DGR_E_UNKNOWN_SESSION: session {session_id!r} is not open")
        if epoch < entry.epoch:
            raise self._stale(session_id, epoch, entry)
        if epoch > entry.epoch:
            raise UnknownSession(
                f"DGR_E_UNKNOWN_SESSION: session {session_id!r} epoch {epoch} is not open "
                f"(open epoch {entry.epoch})"
            )
        return entry

    @staticmethod
    def _stale(session_id: str, epoch: int, entry: _Entry) -> StaleEpoch:
        return StaleEpoch(
            f"DGR_E_STALE_EPOCH: session {session_id!r} epoch {epoch} is older than the open "
            f"epoch {entry.epoch}",
            session_id=session_id,
            epoch=epoch,
            held_epoch=entry.epoch,
        )


@contextlib.contextmanager
def _naming(session_id: str, key: int) -> Iterator[None]:
    """Engine messages name the engine's key; add the wire id (same exception, same status)."""
    try:
        yield
    except EngineError as exc:
        _named(exc, session_id, key)
        raise


def _named(exc: EngineError, session_id: str, key: int) -> EngineError:
    """``exc`` with the wire id after the engine's key in its message (same object)."""
    exc.args = (f"{exc.args[0] if exc.args else ''} [session {session_id!r} = key {key}]",)
    return exc
