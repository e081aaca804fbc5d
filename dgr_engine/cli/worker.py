"""Serve one layer range of a GGUF over gRPC (dgr.shard.v1).

Prints one line "LISTENING HOST:PORT" on stdout once it serves (port 0 picks a free port) and
logs to stderr. On SIGTERM or SIGINT it closes every session and the engine, prints
"STOPPED sessions_closed=N" and exits 0. Exit 2: bad arguments, a model that cannot be loaded,
or an address that cannot be bound.

--tls-cert and --tls-key serve TLS only; --client-ca also requires client certificates of that
CA (mutual TLS). Without TLS the worker serves a loopback --host only, unless
--allow-plaintext-remote says otherwise (then it logs a warning). --grant-key ID=PEM (repeat
for rotation) makes every open need the tracker's route grant for exactly that session, epoch and
stage; later frames and the close carry the session secret the open returned.

--metrics-port serves Prometheus metrics on --metrics-host (default 127.0.0.1, whatever --host
is); --metrics-tls serves them over HTTPS with the worker's certificate (and, with --client-ca,
requires a client certificate of that CA).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from loguru import logger

from dgr_engine.argtypes import float_in, int_in, layer_range
from dgr_engine.certification.lane import BATCHING_CO_BATCH
from dgr_engine.cli._evidence_args import add_evidence_arguments
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.options import EngineOptions
from dgr_engine.wire.keepalive import HELLO_SECONDS

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from dgr_engine.artifacts.shard import ShardArtifacts
    from dgr_engine.security.tls import ClientTls, ServerTls
    from dgr_engine.worker import WorkerConfig
    from dgr_engine.worker.reporting.identity import BuildIdentity


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (``None``: it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the port is in use"
            return exc.strerror or str(exc)
    return None


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        help="the GGUF file to serve, or a catalog name (dgr models list; fetched when missing)",
    )
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    model.add_argument(
        "--manifest",
        type=Path,
        help="a split model's manifest: serve from the files of --root that the range needs "
        "(verified first, unless a verification state still vouches for them)",
    )
    p.add_argument("--root", default=None, help="with --manifest: the storage root")
    p.add_argument(
        "--allow-temp-root",
        action="store_true",
        help="with --manifest: accept a storage root in a temporary directory (tests only)",
    )
    p.add_argument(
        "--layers",
        type=layer_range,
        required=True,
        help="owned range A:B = layers [A, B); A: to end",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS with this certificate")
    p.add_argument("--tls-key", type=Path, default=None, help="...and this private key (PEM)")
    p.add_argument(
        "--client-ca",
        type=Path,
        default=None,
        help="with TLS: require client certificates signed by this CA (mutual TLS)",
    )
    p.add_argument(
        "--chain-tls-ca",
        type=Path,
        default=None,
        help="chained routes: trust next stages' TLS certificates signed by this CA "
        "(docs/chain.md; without it, links go to plaintext next stages only)",
    )
    p.add_argument(
        "--chain-tls-cert",
        type=Path,
        default=None,
        help="...and present this client certificate to a next stage that asks for one",
    )
    p.add_argument("--chain-tls-key", type=Path, default=None, help="...with this key (PEM)")
    p.add_argument(
        "--allow-plaintext-remote",
        action="store_true",
        help="serve plaintext on a non-loopback --host (anyone on the network can read and "
        "inject frames; logged as a warning)",
    )
    p.add_argument(
        "--port", type=int_in(0, 65535), default=0, help="port; 0 picks a free one (default)"
    )
    p.add_argument(
        "--frame-link-port",
        type=int_in(0, 65535),
        default=0,
        help="take frame links (the frame path, the fast data path for chained frames) on this"
        " port (0: a free one, the default; the advert says which; docs/data-paths.md)",
    )
    p.add_argument(
        "--no-frame-link",
        action="store_true",
        help="offer no frame path: chained frames travel over gRPC only",
    )
    p.add_argument(
        "--native-link-port",
        type=int_in(0, 65535),
        default=0,
        help="take native links (the native path: a ring's frames run on the engine's own"
        " thread with no Python per frame) on this port (0: a free one, the default; sealed"
        " with keys from the session secret when the worker serves TLS; docs/native-path.md)",
    )
    p.add_argument(
        "--no-native-link",
        action="store_true",
        help="offer no native path: rings travel over the frame path or gRPC",
    )
    EngineOptions.add_arguments(p)
    p.add_argument(
        "--max-message-bytes",
        type=int_in(64 * 1024, 2**31 - 1),
        default=None,
        help="largest gRPC message taken or sent (default: what the largest frame needs)",
    )
    p.add_argument("--grace", type=float_in(0, 3600), default=2.0, help="shutdown grace in seconds")
    p.add_argument(
        "--admission-wait",
        type=float_in(0, 3600),
        default=5.0,
        help="seconds an open may wait in line for a free session slot before the answer is "
        "busy (first come, first served; default 5); 0: busy at once",
    )
    p.add_argument(
        "--hello-seconds",
        type=float_in(0.1, 600),
        default=HELLO_SECONDS,
        help="how long a connection to the frame or native link port may take to introduce "
        f"itself (TLS handshake and OPEN, or HELLO) before it is dropped (default "
        f"{HELLO_SECONDS:g}; docs/reliability.md)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float_in(0, 3600),
        default=5.0,
        help="a gap this long in the worker's timekeeping (stopped or starved) closes the "
        "sessions unused since, after --resume-grace (default 5); 0: off",
    )
    p.add_argument(
        "--resume-grace",
        type=float_in(0, 3600),
        default=5.0,
        help="seconds a session unused across a stall may still be used (default 5)",
    )
    p.add_argument(
        "--inline-max-rows",
        type=int_in(0, 1 << 20),
        default=1,
        help="frames of at most this many rows run on the event loop when the engine is idle "
        "(no thread hop; default 1: decode steps); 0 turns it off",
    )
    p.add_argument(
        "--inline-max-ms",
        type=float_in(0, 60_000),
        default=20.0,
        help="...but only while the last such frame took at most this long (default 20)",
    )
    p.add_argument(
        "--co-batch-wait-ms",
        type=float_in(0, 1000),
        default=0.0,
        help="with --batching co-batch: how long an engine call may wait for more sessions' "
        "frames (default 0: never)",
    )
    p.add_argument(
        "--grant-key",
        action="append",
        default=[],
        metavar="ID=PEM",
        help="the tracker's Ed25519 public key (PEM) with its key id; repeat for rotation. An "
        "open then needs a route grant signed by one of them for exactly its session, epoch and "
        "stage",
    )
    p.add_argument(
        "--grant-endpoint",
        default=None,
        help="this stage's endpoint as the tracker's grants name it (default: the bound address)",
    )
    p.add_argument(
        "--metrics-port",
        type=int_in(0, 65535),
        default=None,
        help="serve Prometheus metrics on --metrics-host:PORT (0: a free port); printed as "
        "'METRICS HOST:PORT' before LISTENING",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="with --metrics-port: the address the metrics bind (default 127.0.0.1, whatever "
        "--host is; plaintext beyond loopback is logged as a warning)",
    )
    p.add_argument(
        "--metrics-tls",
        action="store_true",
        help="with --metrics-port: serve the metrics over HTTPS with --tls-cert/--tls-key "
        "(and require client certificates of --client-ca when given)",
    )
    p.add_argument(
        "--sessions-per-client",
        type=int_in(1, 1 << 20),
        default=None,
        help="sessions one client may hold at once (its TLS certificate's name, else its host); "
        "default: no limit beyond --max-sessions",
    )
    p.add_argument(
        "--frames-per-second",
        type=float_in(0.001, 1e6),
        default=None,
        help="forward frames one session may send per second (bursts of 8); default: no limit",
    )
    p.add_argument(
        "--session-lease",
        type=float_in(0, 10**9),
        default=600.0,
        help="close a session nobody has used for this many seconds (default 600); 0: never",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int_in(0, 1 << 20),
        default=256,
        metavar="MIB",
        help="MiB of prompt prefixes kept for clients across sessions, least recently used "
        "first out (default 256; 0: none; docs/prefix-cache.md)",
    )
    add_evidence_arguments(p)
    p.add_argument("--log-level", default="INFO", help="least level logged to stderr")


@attrs.frozen
class WorkerSettings:
    """``dgr worker``'s command line, read once at its edge (:meth:`from_args`): the options as
    given, no file read yet (:func:`_trust` reads the TLS files and grant keys)."""

    model: str | None
    """``--model``: a GGUF path or a catalog name, as given."""
    fixture: str | None
    """``--fixture``: a generated fixture's name."""
    manifest: Path | None
    """``--manifest``: a split model's manifest."""
    root: str | None
    """``--root``: the split model's storage root."""
    allow_temp_root: bool
    """``--allow-temp-root``: accept a storage root in a temporary directory (tests only)."""
    layers: tuple[int, int]
    """``--layers``: the owned range ``[begin, end)`` (``end`` -1: to the last layer)."""
    host: str
    """``--host``: the bind address."""
    port: int
    """``--port``: the gRPC port (0: a free one)."""
    frame_link_port: int | None
    """``--frame-link-port`` (0: a free one); ``None``: ``--no-frame-link``."""
    native_link_port: int | None
    """``--native-link-port`` (0: a free one); ``None``: ``--no-native-link``."""
    tls_cert: Path | None
    """``--tls-cert``: serve TLS with this certificate."""
    tls_key: Path | None
    """``--tls-key``: its private key."""
    client_ca: Path | None
    """``--client-ca``: require client certificates of this CA."""
    chain_tls_ca: Path | None
    """``--chain-tls-ca``: trust next stages' certificates of this CA."""
    chain_tls_cert: Path | None
    """``--chain-tls-cert``: the client certificate shown to a next stage."""
    chain_tls_key: Path | None
    """``--chain-tls-key``: its key."""
    allow_plaintext_remote: bool
    """``--allow-plaintext-remote``: plaintext on a non-loopback host."""
    options: EngineOptions
    """The engine options."""
    max_message_bytes: int | None
    """``--max-message-bytes`` (``None``: what the largest frame needs)."""
    grace: float
    """``--grace``: shutdown grace in seconds."""
    admission_wait: float
    """``--admission-wait``: seconds an open may wait for a free session slot."""
    stall_seconds: float
    """``--stall-seconds``: the timekeeping gap that closes sessions unused since (0: off)."""
    hello_seconds: float
    """``--hello-seconds``: how long a side port's connection may take to introduce itself."""
    resume_grace: float
    """``--resume-grace``: seconds a session unused across a stall may still be used."""
    inline_max_rows: int
    """``--inline-max-rows``: frames this small run on the event loop (0: off)."""
    inline_max_ms: float
    """``--inline-max-ms``: ...while the last such frame took at most this long."""
    co_batch_wait_ms: float
    """``--co-batch-wait-ms``: how long a co-batched engine call may wait for more frames."""
    grant_key_specs: tuple[str, ...]
    """``--grant-key``: the tracker's keys as given, ``ID=PEM`` each."""
    grant_endpoint: str | None
    """``--grant-endpoint``: this stage's endpoint as grants name it."""
    metrics_port: int | None
    """``--metrics-port`` (``None``: metrics not served)."""
    metrics_host: str | None
    """``--metrics-host`` (``None``: 127.0.0.1)."""
    metrics_tls: bool
    """``--metrics-tls``: serve the metrics over HTTPS."""
    sessions_per_client: int | None
    """``--sessions-per-client`` (``None``: no limit beyond the slots)."""
    frames_per_second: float | None
    """``--frames-per-second`` per session (``None``: no limit)."""
    session_lease: float
    """``--session-lease``: seconds an unused session lives (0: forever)."""
    prefix_cache_mb: int
    """``--prefix-cache-mb``: MiB of kept prompt prefixes (0: none)."""
    evidence: Path | None
    """``--evidence``: the certification records (``None``: the default directory)."""
    lock: Path | None
    """``--lock``: the lock records must be made under."""
    log_level: str
    """``--log-level``: the least level logged to stderr."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerSettings:
        """The settings :func:`configure` parsed."""
        return cls(
            model=args.model,
            fixture=args.fixture,
            manifest=args.manifest,
            root=args.root,
            allow_temp_root=args.allow_temp_root,
            layers=args.layers,
            host=args.host,
            port=args.port,
            frame_link_port=None if args.no_frame_link else args.frame_link_port,
            native_link_port=None if args.no_native_link else args.native_link_port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            client_ca=args.client_ca,
            chain_tls_ca=args.chain_tls_ca,
            chain_tls_cert=args.chain_tls_cert,
            chain_tls_key=args.chain_tls_key,
            allow_plaintext_remote=args.allow_plaintext_remote,
            options=EngineOptions.from_args(args),
            max_message_bytes=args.max_message_bytes,
            grace=args.grace,
            admission_wait=args.admission_wait,
            stall_seconds=args.stall_seconds,
            hello_seconds=args.hello_seconds,
            resume_grace=args.resume_grace,
            inline_max_rows=args.inline_max_rows,
            inline_max_ms=args.inline_max_ms,
            co_batch_wait_ms=args.co_batch_wait_ms,
            grant_key_specs=tuple(args.grant_key),
            grant_endpoint=args.grant_endpoint,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            metrics_tls=args.metrics_tls,
            sessions_per_client=args.sessions_per_client,
            frames_per_second=args.frames_per_second,
            session_lease=args.session_lease,
            prefix_cache_mb=args.prefix_cache_mb,
            evidence=args.evidence,
            lock=args.lock,
            log_level=args.log_level,
        )

    def certify_command(self) -> str:
        """The ``dgr certify`` command that certifies the lane these settings serve, on this
        machine with this build: its model (a catalog name as given, a file by its absolute
        path), the engine options that are part of the lane and differ from the defaults, and
        the evidence directory and lock it reads when given. ``""`` for a split model (``dgr
        certify`` takes one file)."""
        from dgr_engine.models.catalog import CATALOG

        if self.fixture is not None:
            argv = ["dgr", "certify", "--fixture", self.fixture]
        elif self.model is not None:
            model = self.model if self.model in CATALOG else os.path.abspath(self.model)
            argv = ["dgr", "certify", "--model", model]
        else:
            return ""
        argv += self.options.lane_argv()
        for flag, path in (("--evidence", self.evidence), ("--lock", self.lock)):
            if path is not None:
                argv += [flag, os.path.abspath(path)]
        return shlex.join(argv)


@attrs.frozen
class WorkerTrust:
    """What the worker's TLS and grant files say, read by :func:`_trust` before any work."""

    tls: ServerTls | None
    """The TLS it serves (``None``: plaintext)."""
    chain_tls: ClientTls | None
    """How it dials next stages of chained routes (``None``: plaintext next stages only)."""
    grant_keys: dict[str, Ed25519PublicKey] | None
    """The tracker's public keys by key id (``None``: no grant needed)."""


def run(args: argparse.Namespace) -> int:
    settings = WorkerSettings.from_args(args)
    log_to_stderr(settings.log_level)
    if settings.manifest is None and (settings.root is not None or settings.allow_temp_root):
        print("dgr worker: error: --root and --allow-temp-root go with --manifest", file=sys.stderr)
        return 2
    try:
        trust = _trust(settings)
    except ValueError as exc:
        print(f"dgr worker: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(settings, trust))


def _trust(settings: WorkerSettings) -> WorkerTrust:
    """The TLS and grant files the settings name, read; ``ValueError`` naming a mistake."""
    tls = _server_tls(settings)
    _check_metrics(settings, tls)
    chain_tls = _chain_tls(settings)
    return WorkerTrust(tls, chain_tls, _grant_keys(settings.grant_key_specs))


def _grant_keys(specs: tuple[str, ...]) -> dict[str, Ed25519PublicKey] | None:
    """``ID=PEM`` pairs as keys by id; ``ValueError`` naming a bad one."""
    from dgr_engine.security.grants import load_public_key

    keys = {}
    for spec in specs:
        key_id, sep, path = spec.partition("=")
        if not sep or not key_id or not path:
            raise ValueError(f"--grant-key expects ID=PEM, got {spec!r}")
        if key_id in keys:
            raise ValueError(f"--grant-key: key id {key_id!r} given twice")
        keys[key_id] = load_public_key(path)
    return keys or None


def _server_tls(settings: WorkerSettings) -> ServerTls | None:
    """The TLS the flags ask for (files read now); ``ValueError`` on a half-given pair, a CA
    without TLS, an unreadable file, or plaintext beyond loopback without the explicit flag."""
    from dgr_engine.security.tls import ServerTls, check_plaintext_bind

    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if settings.tls_cert is None:
        if settings.client_ca is not None:
            raise ValueError("--client-ca needs --tls-cert and --tls-key")
        check_plaintext_bind(settings.host, settings.allow_plaintext_remote)
        return None
    assert settings.tls_key is not None
    return ServerTls.from_files(settings.tls_cert, settings.tls_key, settings.client_ca)


def _check_metrics(settings: WorkerSettings, tls: ServerTls | None) -> None:
    """``ValueError`` for metrics flags without a metrics port, or TLS metrics without TLS."""
    if settings.metrics_port is None and (
        settings.metrics_host is not None or settings.metrics_tls
    ):
        raise ValueError("--metrics-host and --metrics-tls go with --metrics-port")
    if settings.metrics_tls and tls is None:
        raise ValueError("--metrics-tls needs --tls-cert and --tls-key")


def _chain_tls(settings: WorkerSettings) -> ClientTls | None:
    """How the worker dials next stages of chained routes; ``ValueError`` for a certificate or
    key without the CA, or an unreadable file."""
    from dgr_engine.security.tls import ClientTls

    if settings.chain_tls_ca is None:
        if settings.chain_tls_cert is not None or settings.chain_tls_key is not None:
            raise ValueError("--chain-tls-cert and --chain-tls-key need --chain-tls-ca")
        return None
    return ClientTls.from_files(
        settings.chain_tls_ca, settings.chain_tls_cert, settings.chain_tls_key
    )


def _busy_port(settings: WorkerSettings) -> bool:
    """Whether a port the settings name cannot be bound (said in the log): checked before
    loading anything, so that a busy port is one line, at once."""
    for port in (settings.port, settings.frame_link_port or 0, settings.native_link_port or 0):
        if port:
            problem = port_problem(settings.host, port)
            if problem is not None:
                logger.error("cannot serve on {}:{}: {}", settings.host, port, problem)
                return True
    return False


def _worker_config(settings: WorkerSettings, trust: WorkerTrust) -> WorkerConfig:
    """How the worker serves, from its settings and what their files say."""
    from dgr_engine.certification.record import default_evidence_dir
    from dgr_engine.worker import WorkerConfig

    lease = settings.session_lease
    return WorkerConfig(
        host=settings.host,
        port=settings.port,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.grace,
        inline_max_rows=settings.inline_max_rows,
        inline_max_ms=settings.inline_max_ms,
        co_batch=settings.options.batching == BATCHING_CO_BATCH,
        co_batch_wait_ms=settings.co_batch_wait_ms,
        session_lease_seconds=lease if lease > 0 else None,
        prefix_cache_bytes=settings.prefix_cache_mb << 20,
        evidence_dir=settings.evidence if settings.evidence is not None else default_evidence_dir(),
        lock_path=settings.lock,
        admission_wait_seconds=settings.admission_wait,
        stall_seconds=settings.stall_seconds,
        frame_link_hello_seconds=settings.hello_seconds,
        resume_grace_seconds=settings.resume_grace,
        tls=trust.tls,
        chain_tls=trust.chain_tls,
        allow_plaintext_remote=settings.allow_plaintext_remote,
        sessions_per_client=settings.sessions_per_client,
        grant_keys=trust.grant_keys,
        grant_endpoint=settings.grant_endpoint,
        metrics_port=settings.metrics_port,
        frame_link_port=settings.frame_link_port,
        native_link_port=settings.native_link_port,
        metrics_host=settings.metrics_host if settings.metrics_host is not None else "127.0.0.1",
        metrics_tls=settings.metrics_tls,
        frames_per_second=settings.frames_per_second,
        certify_command=settings.certify_command(),
    )


async def _serve(settings: WorkerSettings, trust: WorkerTrust) -> int:
    from dgr_engine.errors import EngineError
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.models import resolve_model
    from dgr_engine.worker import ShardWorker
    from dgr_engine.worker.engine_access.preflight import preflight
    from dgr_engine.worker.reporting.identity import BuildIdentity
    from dgr_engine.worker.reporting.start_times import StartTimes
    from dgr_session.errors import DgrError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _busy_port(settings):
        return 2
    config = _worker_config(settings, trust)
    try:
        options = settings.options

        def load() -> ShardWorker:
            build = None
            if settings.manifest is not None:
                artifacts = _split_artifacts(settings)
                model, build = artifacts.first, BuildIdentity.of_artifacts(artifacts)
                logger.info(
                    "split model {}: {} of {} files in {}, {}",
                    artifacts.manifest.sha256[:16],
                    len(artifacts.files),
                    len(artifacts.manifest.files),
                    artifacts.root,
                    artifacts.verification,
                )
            elif settings.model is not None:
                model = resolve_model(settings.model, notice=lambda text: logger.info("{}", text))
            else:
                assert settings.fixture is not None  # the parser requires one of the three
                model = ensure_fixture(settings.fixture)
            header = preflight(
                model,
                settings.layers,
                n_ctx_per_session=options.n_ctx_per_session,
                max_sessions=options.max_sessions,
            )
            started.lap("header")  # the model found (fetched where missing) and its header read
            if build is None:
                build = BuildIdentity.of_model(model, header)
            started.lap("hash")
            loaded = ShardWorker.load(
                model,
                settings.layers,
                config=_with_own_lane(config, settings, model, build),
                build=build,
                header=header,
                **options.engine_kwargs(),
            )
            started.lap("engine")  # the layers loaded, the lane's certification looked up
            return loaded

        started = StartTimes()

        # checking and loading run in a thread that cannot be interrupted (slow storage, a large
        # file): a signal meanwhile ends the process at once (nothing is served or held yet)
        logger.debug("loading layers {}", settings.layers)
        loading = asyncio.ensure_future(asyncio.to_thread(load))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            logger.warning("stopped while loading the model")
            print("STOPPED sessions_closed=0", flush=True)
            sys.stderr.flush()
            os._exit(0)  # the loading thread holds no state worth waiting for
        stopping.cancel()
        worker = loading.result()
    except (EngineError, DgrError, OSError, ValueError) as exc:
        logger.error("cannot start the worker: {}", exc)
        return 2
    try:
        address = await worker.start()
    except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError when it cannot bind
        logger.error("cannot serve on {}:{}: {}", settings.host, settings.port, exc)
        await worker.stop()
        return 2
    started.lap("serve")  # every port bound, the first advert made
    logger.info("{}", started.text())
    try:
        if not stop.is_set():
            if worker.metrics_port:
                print(f"METRICS {worker.metrics_address}", flush=True)
            print(f"LISTENING {address}", flush=True)
            await stop.wait()
    finally:
        closed = await worker.stop()
    print(f"STOPPED sessions_closed={closed}", flush=True)
    return 0


def _with_own_lane(
    config: WorkerConfig, settings: WorkerSettings, model: Path, build: BuildIdentity
) -> WorkerConfig:
    """``config`` that also looks in the operator's own lock for this model when the defaults
    certify no lane of it: a single-file model no lock or evidence is named for
    (``dgr certify --model M`` certifies there: ``dgr_engine/cli/_own_model.py``)."""
    from dgr_engine.cli._own_model import applies, held_own_lane

    if settings.manifest is not None or settings.fixture is not None:
        return config
    if not applies(lock=settings.lock, evidence=settings.evidence, model=model):
        return config
    own = held_own_lane(build.model_sha256.hex())
    if own is None:
        return config
    return attrs.evolve(config, own_lane=(own.lock, own.evidence))


def certify_command(args: argparse.Namespace) -> str:
    """The ``dgr certify`` command that certifies the lane a parsed ``dgr worker`` command line
    serves: :meth:`WorkerSettings.certify_command` of its settings (an edge of its own, for
    callers holding a parsed command line)."""
    return WorkerSettings.from_args(args).certify_command()


def _split_artifacts(settings: WorkerSettings) -> ShardArtifacts:
    """The verified files of ``--manifest`` in ``--root`` that ``--layers`` needs."""
    from dgr_engine.artifacts import shard
    from dgr_engine.artifacts.manifest import load_manifest
    from dgr_engine.artifacts.storage import storage_root

    assert settings.manifest is not None
    manifest = load_manifest(settings.manifest)
    root = storage_root(settings.root, allow_temp=settings.allow_temp_root)
    return shard.prepare(manifest, root, settings.layers)
