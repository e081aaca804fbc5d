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

from loguru import logger

from dgr_engine.argtypes import float_in, int_in, layer_range
from dgr_engine.certification.lane import BATCHING_CO_BATCH
from dgr_engine.cli._evidence_args import add_evidence_arguments
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.options import EngineOptions

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from dgr_engine.artifacts.shard import ShardArtifacts
    from dgr_engine.security.tls import ClientTls, ServerTls


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
        help="serve the frame link, the fast data path for chained frames, on this port (0: a "
        "free one, the default; the advert says which; docs/data-paths.md)",
    )
    p.add_argument(
        "--no-frame-link",
        action="store_true",
        help="offer no frame link: chained frames travel over gRPC only",
    )
    p.add_argument(
        "--native-link-port",
        type=int_in(0, 65535),
        default=0,
        help="serve native links, a ring's frames run on the engine's own thread with no "
        "Python per frame, on this port (0: a free one, the default; sealed with keys from "
        "the session secret when the worker serves TLS; docs/native-link.md)",
    )
    p.add_argument(
        "--no-native-link",
        action="store_true",
        help="offer no native link: rings travel over the frame link or gRPC",
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
    add_evidence_arguments(p)
    p.add_argument("--log-level", default="INFO", help="least level logged to stderr")


def run(args: argparse.Namespace) -> int:
    log_to_stderr(args.log_level)
    if args.manifest is None and (args.root is not None or args.allow_temp_root):
        print("dgr worker: error: --root and --allow-temp-root go with --manifest", file=sys.stderr)
        return 2
    try:
        args.tls = _server_tls(args)
        _check_metrics_args(args)
        args.chain_tls = _chain_tls(args)
        args.grant_keys = _grant_keys(args.grant_key)
    except ValueError as exc:
        print(f"dgr worker: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args))


def _grant_keys(specs: list[str]) -> dict[str, Ed25519PublicKey] | None:
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


def _server_tls(args: argparse.Namespace) -> ServerTls | None:
    """The TLS the flags ask for (files read now); ``ValueError`` on a half-given pair, a CA
    without TLS, an unreadable file, or plaintext beyond loopback without the explicit flag."""
    from dgr_engine.security.tls import ServerTls, check_plaintext_bind

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        if args.client_ca is not None:
            raise ValueError("--client-ca needs --tls-cert and --tls-key")
        check_plaintext_bind(args.host, args.allow_plaintext_remote)
        return None
    return ServerTls.from_files(args.tls_cert, args.tls_key, args.client_ca)


def _check_metrics_args(args: argparse.Namespace) -> None:
    """``ValueError`` for metrics flags without a metrics port, or TLS metrics without TLS."""
    if args.metrics_port is None and (args.metrics_host is not None or args.metrics_tls):
        raise ValueError("--metrics-host and --metrics-tls go with --metrics-port")
    if args.metrics_tls and args.tls is None:
        raise ValueError("--metrics-tls needs --tls-cert and --tls-key")


def _chain_tls(args: argparse.Namespace) -> ClientTls | None:
    """How the worker dials next stages of chained routes; ``ValueError`` for a certificate or
    key without the CA, or an unreadable file."""
    from dgr_engine.security.tls import ClientTls

    if args.chain_tls_ca is None:
        if args.chain_tls_cert is not None or args.chain_tls_key is not None:
            raise ValueError("--chain-tls-cert and --chain-tls-key need --chain-tls-ca")
        return None
    return ClientTls.from_files(args.chain_tls_ca, args.chain_tls_cert, args.chain_tls_key)


async def _serve(args: argparse.Namespace) -> int:
    from dgr_engine.certification.record import default_evidence_dir
    from dgr_engine.errors import EngineError
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.models import resolve_model
    from dgr_engine.worker import ShardWorker, WorkerConfig
    from dgr_engine.worker.identity import BuildIdentity
    from dgr_engine.worker.preflight import preflight
    from dgr_engine.worker.start_times import StartTimes
    from dgr_session.errors import DgrError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    native_port = 0 if args.no_native_link else args.native_link_port
    for port in (args.port, 0 if args.no_frame_link else args.frame_link_port, native_port):
        if port:  # before loading anything: a busy port is one line, at once
            problem = port_problem(args.host, port)
            if problem is not None:
                logger.error("cannot serve on {}:{}: {}", args.host, port, problem)
                return 2
    config = WorkerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        grace_seconds=args.grace,
        inline_max_rows=args.inline_max_rows,
        inline_max_ms=args.inline_max_ms,
        co_batch=args.batching == BATCHING_CO_BATCH,
        co_batch_wait_ms=args.co_batch_wait_ms,
        session_lease_seconds=args.session_lease if args.session_lease > 0 else None,
        evidence_dir=args.evidence if args.evidence is not None else default_evidence_dir(),
        lock_path=args.lock,
        admission_wait_seconds=args.admission_wait,
        stall_seconds=args.stall_seconds,
        resume_grace_seconds=args.resume_grace,
        tls=args.tls,
        chain_tls=args.chain_tls,
        allow_plaintext_remote=args.allow_plaintext_remote,
        sessions_per_client=args.sessions_per_client,
        grant_keys=args.grant_keys,
        grant_endpoint=args.grant_endpoint,
        metrics_port=args.metrics_port,
        frame_link_port=None if args.no_frame_link else args.frame_link_port,
        native_link_port=None if args.no_native_link else args.native_link_port,
        metrics_host=args.metrics_host if args.metrics_host is not None else "127.0.0.1",
        metrics_tls=args.metrics_tls,
        frames_per_second=args.frames_per_second,
        certify_command=certify_command(args),
    )
    try:
        options = EngineOptions.from_args(args)

        def load() -> ShardWorker:
            build = None
            if args.manifest is not None:
                artifacts = _split_artifacts(args)
                model, build = artifacts.first, BuildIdentity.of_artifacts(artifacts)
                logger.info(
                    "split model {}: {} of {} files in {}, {}",
                    artifacts.manifest.sha256[:16],
                    len(artifacts.files),
                    len(artifacts.manifest.files),
                    artifacts.root,
                    artifacts.verification,
                )
            else:
                model = (
                    resolve_model(args.model, notice=lambda text: logger.info("{}", text))
                    if args.model is not None
                    else ensure_fixture(args.fixture)
                )
            header = preflight(
                model,
                args.layers,
                n_ctx_per_session=options.n_ctx_per_session,
                max_sessions=options.max_sessions,
            )
            started.lap("header")  # the model found (fetched where missing) and its header read
            if build is None:
                build = BuildIdentity.of_model(model, header)
            started.lap("hash")
            loaded = ShardWorker.load(
                model,
                args.layers,
                config=config,
                build=build,
                header=header,
                **options.engine_kwargs(),
            )
            started.lap("engine")  # the layers loaded, the lane's certification looked up
            return loaded

        started = StartTimes()

        # checking and loading run in a thread that cannot be interrupted (slow storage, a large
        # file): a signal meanwhile ends the process at once (nothing is served or held yet)
        logger.debug("loading layers {}", args.layers)
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
        logger.error("cannot serve on {}:{}: {}", args.host, args.port, exc)
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


def certify_command(args: argparse.Namespace) -> str:
    """The ``dgr certify`` command that certifies the lane this command line serves, on this
    machine with this build: its model (a catalog name as given, a file by its absolute path),
    the engine options that are part of the lane and differ from the defaults, and the
    evidence directory and lock it reads when given. ``""`` for a split model (``dgr certify``
    takes one file)."""
    from dgr_engine.models.catalog import CATALOG

    if args.fixture is not None:
        argv = ["dgr", "certify", "--fixture", args.fixture]
    elif args.model is not None:
        model = args.model if args.model in CATALOG else os.path.abspath(args.model)
        argv = ["dgr", "certify", "--model", model]
    else:
        return ""
    argv += EngineOptions.from_args(args).lane_argv()
    for flag, path in (("--evidence", args.evidence), ("--lock", args.lock)):
        if path is not None:
            argv += [flag, os.path.abspath(path)]
    return shlex.join(argv)


def _split_artifacts(args: argparse.Namespace) -> ShardArtifacts:
    """The verified files of ``--manifest`` in ``--root`` that ``--layers`` needs."""
    from dgr_engine.artifacts import shard
    from dgr_engine.artifacts.manifest import load_manifest
    from dgr_engine.artifacts.storage import storage_root

    manifest = load_manifest(args.manifest)
    root = storage_root(args.root, allow_temp=args.allow_temp_root)
    return shard.prepare(manifest, root, args.layers)
