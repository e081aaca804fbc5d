"""The binding of a native link (``ShardEngine.start_link``): one session epoch's frames run by
the native library's own thread, from one connected socket to the next, with no Python per frame
(``docs/native-path.md``; the C side is ``native/src/dgr_link.cpp``, its messages
``wire/link_messages.py``). The caller is the control shell: it opens the session on the engine,
connects and authenticates the sockets, starts the link (which then owns them), reads its
counters while it runs, and ends it.
"""

from __future__ import annotations

import enum
import socket
from typing import Any

import attrs

from dgr_engine._binding import check_status, ffi, lib, status_name
from dgr_engine.engine.sampling import native_sampling
from dgr_engine.status import error_for_code
from dgr_session.sampling import GREEDY, Sampling

DEFAULT_BODY_TIMEOUT = 10.0
"""Seconds a link waits for the rest of a frame whose header came (then: truncated)."""


class LinkState(enum.IntEnum):
    RUNNING = int(lib.DGR_LINK_STATE_RUNNING)
    ENDED = int(lib.DGR_LINK_STATE_ENDED)
    """A peer closed its socket, or the link was closed."""
    FAILED = int(lib.DGR_LINK_STATE_FAILED)
    """A frame failed here, or at a stage before this one (``failed_hop``)."""


@attrs.frozen
class LinkStats:
    """A link's state and counters."""

    state: LinkState
    status: str
    """``DGR_OK`` or the failure's status name."""
    failed_hop: int
    error: str
    frames: int
    rows: int
    bytes_in: int
    bytes_out: int
    engine_ns: int
    busy_ns: int
    """From each frame's header to its output's send to the route's next step (the next stage,
    or a ring's first): the checks, the engine and the copies, not the send itself."""
    last_frame_ns: int
    """``time.monotonic_ns()`` at the end of the last frame (0: none yet)."""
    tokens: int
    ring_frames: int
    kind_frames: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Frames run by row kind: unspecified, prefill, decode, replay (a ring's own: decode)."""
    kind_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Their rows by row kind."""
    throttled: int = 0
    """Frames that waited for the session's frame budget (``frames_per_second``)."""
    throttled_ns: int = 0
    """How long they waited, in all."""
    co_batched: int = 0
    """Frames that shared their engine call with another session's (co-batching)."""

    def failure(self) -> Exception | None:
        """The typed error of a failed link (``None`` unless ``FAILED``)."""
        if self.state is not LinkState.FAILED:
            return None
        code = int(getattr(lib, self.status, lib.DGR_E_INTERNAL))
        return error_for_code(code, f"stage {self.failed_hop}: {self.error}")


@attrs.frozen(repr=False)
class LinkKeys:
    """A sealed link's keys, one per socket and direction (32 bytes each; ``wire/link_seal.py``):
    what ``inbound`` and ``ring_in`` bring is opened with theirs, what goes to ``outbound`` and
    ``ring_out`` is sealed with theirs."""

    inbound: bytes
    outbound: bytes
    ring_in: bytes = bytes(32)
    ring_out: bytes = bytes(32)


@attrs.frozen
class LinkSockets:
    """The connected sockets of one stage's link (the link owns them once started)."""

    inbound: socket.socket
    """Frames from the stage before (from the client, on the first stage)."""
    outbound: socket.socket
    """To the next stage; on the last stage, the client's token stream."""
    ring_in: socket.socket | None = None
    """A ring's first stage: frames from its last stage."""
    ring_out: socket.socket | None = None
    """A ring's last stage: frames to its first stage."""
    keys: LinkKeys | None = None
    """A sealed link's keys (``wire/link_seal.py``); ``None``: the messages go in the clear."""
    ring_in_hop: int = 0
    """A ring's first stage: the index of the stage ``ring_in`` comes from (its last), the
    sender a malformed ring frame names."""

    def all(self) -> tuple[socket.socket, ...]:
        held = (self.inbound, self.outbound, self.ring_in, self.ring_out)
        return tuple(s for s in held if s is not None)


def _fd(sock: socket.socket | None) -> int:
    if sock is None:
        return -1
    sock.setblocking(True)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock.fileno()


class NativeLink:
    """A running link (see the module's text). Not made directly: ``ShardEngine.start_link``."""

    def __init__(
        self,
        engine_handle: Any,
        session_id: int,
        epoch: int,
        *,
        hop: int,
        sockets: LinkSockets,
        max_rows: int,
        notify_fd: int = -1,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        frames_per_second: float | None = None,
        burst: int = 8,
        co_batch: Any = None,
        sampling: Sampling = GREEDY,
    ) -> None:
        params = ffi.new("dgr_link_params *")
        params.sampling = native_sampling(sampling)[0]
        params.session_id = session_id
        params.epoch = epoch
        params.hop = hop
        params.max_rows = max_rows
        params.in_fd = _fd(sockets.inbound)
        params.ring_in_fd = _fd(sockets.ring_in)
        params.ring_in_hop = sockets.ring_in_hop
        params.out_fd = _fd(sockets.outbound)
        params.ring_out_fd = _fd(sockets.ring_out)
        params.notify_fd = notify_fd
        params.body_timeout_ms = max(1, int(body_timeout * 1000))
        params.frames_per_second = frames_per_second or 0.0
        params.burst = max(1, burst)
        params.batch = ffi.NULL if co_batch is None else co_batch
        out = ffi.new("dgr_link **")
        if sockets.keys is None:
            check_status(lib.dgr_link_start(engine_handle, params, out))
        else:
            keys = ffi.new("dgr_link_keys *")
            k = sockets.keys
            given = (("in", k.inbound), ("ring_in", k.ring_in), ("out", k.outbound))
            for name, key in (*given, ("ring_out", k.ring_out)):
                if len(key) != int(lib.DGR_LINK_KEY_BYTES):
                    raise ValueError(f"a link key is 32 bytes, not {len(key)} ({name})")
                ffi.memmove(getattr(keys, name), key, len(key))
            check_status(lib.dgr_link_start_sealed(engine_handle, params, keys, out))
        for sock in sockets.all():
            sock.detach()  # the link closes them
        self._handle: Any = ffi.gc(out[0], lib.dgr_link_free)
        self._engine_handle = engine_handle  # kept alive while the link runs
        self.session_id, self.epoch, self.hop = session_id, epoch, hop

    def stats(self) -> LinkStats:
        """The link's state and counters now (the last ones read, once closed)."""
        if self._handle is None:
            return self._final
        s = ffi.new("dgr_link_stats *")
        check_status(lib.dgr_link_get_stats(self._handle, s))
        return LinkStats(
            state=LinkState(int(s.state)),
            status=status_name(int(s.status)),
            failed_hop=int(s.failed_hop),
            error=ffi.string(s.error).decode(errors="replace"),
            frames=int(s.frames),
            rows=int(s.rows),
            bytes_in=int(s.bytes_in),
            bytes_out=int(s.bytes_out),
            engine_ns=int(s.engine_ns),
            busy_ns=int(s.busy_ns),
            last_frame_ns=int(s.last_frame_ns),
            tokens=int(s.tokens),
            ring_frames=int(s.ring_frames),
            throttled=int(s.throttled),
            throttled_ns=int(s.throttled_ns),
            co_batched=int(s.co_batched),
            kind_frames=(
                int(s.kind_frames[0]),
                int(s.kind_frames[1]),
                int(s.kind_frames[2]),
                int(s.kind_frames[3]),
            ),
            kind_rows=(
                int(s.kind_rows[0]),
                int(s.kind_rows[1]),
                int(s.kind_rows[2]),
                int(s.kind_rows[3]),
            ),
        )

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> LinkStats:
        """Ends the link (its sockets shut and closed, its thread joined) and returns its last
        counters. Idempotent."""
        if self._handle is not None:
            lib.dgr_link_stop(self._handle)  # its thread joined: the counters are final
            final = self.stats()
            ffi.release(self._handle)
            self._handle = None
            self._final = attrs.evolve(
                final, state=LinkState.ENDED if final.state is LinkState.RUNNING else final.state
            )
        return self._final

    def __repr__(self) -> str:
        return f"<NativeLink session={self.session_id} epoch={self.epoch} hop={self.hop}>"
