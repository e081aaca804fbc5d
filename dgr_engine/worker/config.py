"""How a shard worker serves: :class:`WorkerConfig`, every field saying why (the engine's own
options are ``ShardWorker.load``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dgr_engine.security.tls import ClientTls, ServerTls
from dgr_engine.worker.calls.introductions import HELLO_SECONDS, IntroductionGate


@attrs.frozen
class WorkerConfig:
    """How the worker serves (the engine's own options are ``ShardWorker.load``'s)."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 0
    """Port to bind; 0 picks a free one (see ``ShardWorker.address``)."""
    max_message_bytes: int | None = None
    """Cap on a request and on a reply; ``None``: what ``n_batch`` rows can need."""
    grace_seconds: float = 2.0
    """How long in-flight calls may finish at shutdown before they are cancelled."""
    load_window_seconds: float = 10.0
    """Window of the advert's rows per second and recent errors."""
    inline_max_rows: int = 1
    """Frames of at most this many rows (decode steps) run on the event loop itself when the
    engine thread is idle, saving the hop to the thread and back, while such frames are short
    (``inline_max_ms``; ``docs/worker.md``). 0 turns this off."""
    inline_max_ms: float = 20.0
    """Run small frames on the loop only while the last one took at most this long in the
    engine (the first one always runs on the engine thread, to measure): a model whose decode
    steps are slow never holds the loop, and for it the hop saved is noise anyway."""
    co_batch: bool = False
    """Run frames of different sessions that wait for the engine together in one engine call
    (``dgr_engine.worker.engine_access.co_batch``; recorded in the lane as
    ``batching="co-batch"``)."""
    co_batch_wait_ms: float = 0.0
    """With ``co_batch``: how long a call may wait for more sessions' frames (0: never)."""
    session_lease_seconds: float | None = 600.0
    """A session neither opened nor forwarded for this long is closed by the worker (checked
    while serving, see ``ShardWorker.expire_idle_sessions``); ``None``: never."""
    evidence_dir: Path | None = None
    """Where certification records are read from (``evidence/<class>/<lane-id>/``); the lane
    is certified only by a record of exactly its lane. ``None``: the lane is dark."""
    lock_path: Path | None = None
    """The lock records must be made under (default: ``$DGR_LOCK`` or the checkout's)."""
    prefix_cache_bytes: int = 256 << 20
    """Bytes of kept prompt prefixes (``worker/lifecycle/prefixes.py``,
    ``docs/prefix-cache.md``), least recently used first out; 0: keeps none."""
    own_lane: tuple[Path, Path] | None = None
    """The operator's own lock and evidence directory for this model (``dgr certify --model
    M`` with none named: ``dgr_engine/cli/_own_model.py``), looked in when no record under
    ``lock_path`` in ``evidence_dir`` certifies the lane; ``None``: none."""
    admission_wait_seconds: float = 5.0
    """How long an open may wait in line for a free session slot (first come, first served)
    before it is answered busy (``DGR_E_CAPACITY`` with a retry hint); 0: answer at once. Also
    bounded by the call's own deadline."""
    stall_seconds: float = 5.0
    """A gap this long in the worker's own timekeeping (the process was stopped or starved)
    means its clients have given up waiting on it: sessions unused across the gap get
    ``resume_grace_seconds`` to be used again, then are closed (their clients moved on)."""
    resume_grace_seconds: float = 5.0
    """See ``stall_seconds``."""
    tls: ServerTls | None = None
    """Serve TLS with this certificate (and, with a client CA, require client certificates);
    ``None``: plaintext, allowed on loopback only unless ``allow_plaintext_remote``."""
    allow_plaintext_remote: bool = False
    """Serve plaintext on a non-loopback address (logged as a warning at every start)."""
    sessions_per_client: int | None = None
    """Sessions one client identity (its TLS certificate's name, else its host) may hold;
    ``None``: no limit beyond the worker's slots."""
    frames_per_second: float | None = None
    """Forward frames one session may send per second (bursts of 8); ``None``: no limit."""
    grant_keys: Mapping[str, Ed25519PublicKey] | None = None
    """The tracker's public keys by key id: an open then needs a route grant signed by one of
    them for exactly that session, epoch and stage (``dgr_engine.security.grants``);
    ``None``: none."""
    grant_endpoint: str | None = None
    """This stage's endpoint as the tracker's routes name it (default: the bound address)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on ``metrics_host:metrics_port`` (0: a free port); ``None``:
    counted, not served."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics bind: loopback unless told otherwise, whatever ``host`` is (a
    plaintext one beyond loopback is logged as a warning at every start)."""
    metrics_tls: bool = False
    """Serve the metrics over HTTPS with the worker's own certificate (``tls``, which this
    needs), requiring client certificates of its client CA when it has one."""
    certify_command: str = ""
    """The command that would certify this worker's lane, run on its machine (``dgr certify``
    with its model and lane options; ``dgr worker`` sets it from its own command line): a dark
    worker's advert carries it, so that a client refusing the lane can say how to certify it.
    ``""``: not said."""
    frame_link_port: int | None = 0
    """Take frame links (the frame path, the fast data path for chained frames:
    ``docs/data-paths.md``) on this port of ``host`` (0: a free one; the advert says which);
    ``None``: not offered (chained frames then travel over gRPC only)."""
    frame_link_hello_seconds: float = HELLO_SECONDS
    """How long a frame link connection may take for its TLS handshake and its ``OPEN`` (the
    call it carries), and then for its request (``ChainOutput``) or the start of its first
    frame (``ChainStream``; a large frame, once begun, may take longer), and a native link
    connection for its ``HELLO``: a peer that connects and stays silent holds a place among
    the port's waiting connections (:meth:`introduction_gate`) this long at most, then is
    dropped. Longer than an honest caller needs over a WAN (it sends them at once: a TLS
    handshake's round trips), short enough that silent peers come and go."""
    introductions_per_source: int = 32
    """Connections from one source address that may wait at once for their introduction on
    each side port once they waited a second (``worker/calls/introductions.py``); a newer one
    takes the oldest one's place."""
    introductions_waiting: int = 512
    """Connections that may wait at once for their introduction on each side port, from all
    sources; past it a newcomer takes the place of the oldest connection of the source that
    holds the most. Apart from session capacity: an introduced link never waits for it."""
    native_link_port: int | None = 0
    """Take native links (the native path: a ring's frames run from socket to socket on the
    engine's own thread, ``docs/native-path.md``) on this port of ``host`` (0: a free one; the
    advert says which); ``None``: not offered. With TLS (``tls``) the links are sealed:
    introductions that prove the session secret, every message ChaCha20-Poly1305-sealed with
    keys they derive (``wire/link_seal.py``). Its connections' hellos take
    ``frame_link_hello_seconds`` at most."""
    chain_tls: ClientTls | None = None
    """How this worker dials the next stage of a chained route that serves TLS (the CA it
    trusts, and its client certificate for a next stage that asks for one); ``None``: it
    links only to plaintext next stages (``docs/chain.md``)."""

    def introduction_gate(self) -> IntroductionGate:
        """A side port's gate for connections not yet introduced (one per port)."""
        return IntroductionGate(
            per_source=self.introductions_per_source, total=self.introductions_waiting
        )

    def __attrs_post_init__(self) -> None:
        lease = self.session_lease_seconds
        if lease is not None and not lease > 0:
            raise ValueError(f"session_lease_seconds must be > 0 or None, got {lease}")
        hello = self.frame_link_hello_seconds
        if not 0 < hello < float("inf"):
            raise ValueError(f"frame_link_hello_seconds must be finite and > 0, got {hello}")
        for name in ("admission_wait_seconds", "stall_seconds", "resume_grace_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.metrics_tls and self.tls is None:
            raise ValueError("metrics_tls needs the worker's TLS (tls)")
