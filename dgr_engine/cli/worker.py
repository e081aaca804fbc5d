"""Serve one layer range of a GGUF over gRPC (dgr.shard.v1).

Prints one line "LISTENING HOST:PORT" on stdout once it serves (port 0 picks a free port) and
logs to stderr. On SIGTERM or SIGINT it closes every session and the engine, prints
"STOPPED sessions_closed=N" and exits 0. Exit 2: bad arguments, a model that cannot be loaded,
or an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from loguru import logger

from dgr_engine.cli._evidence_args import add_evidence_arguments
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.options import EngineOptions


def _layers(text: str) -> tuple[int, int]:
    begin, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(begin), int(end) if end else -1
    except ValueError:
        message = f"expected A:B (or A: for 'to the end'), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="the GGUF file to serve")
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    p.add_argument(
        "--layers", type=_layers, required=True, help="owned range A:B = layers [A, B); A: to end"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    EngineOptions.add_arguments(p)
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest gRPC message taken or sent (default: what the largest frame needs)",
    )
    p.add_argument("--grace", type=float, default=2.0, help="shutdown grace in seconds")
    p.add_argument(
        "--admission-wait",
        type=float,
        default=5.0,
        help="seconds an open may wait in line for a free session slot before the answer is "
        "busy (first come, first served; default 5); 0: busy at once",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=5.0,
        help="a gap this long in the worker's timekeeping (stopped or starved) closes the "
        "sessions unused since, after --resume-grace (default 5); 0: off",
    )
    p.add_argument(
        "--resume-grace",
        type=float,
        default=5.0,
        help="seconds a session unused across a stall may still be used (default 5)",
    )
    p.add_argument(
        "--inline-max-rows",
        type=int,
        default=1,
        help="frames of at most this many rows run on the event loop when the engine is idle "
        "(no thread hop; default 1: decode steps); 0 turns it off",
    )
    p.add_argument(
        "--inline-max-ms",
        type=float,
        default=20.0,
        help="...but only while the last such frame took at most this long (default 20)",
    )
    p.add_argument(
        "--session-lease",
        type=float,
        default=600.0,
        help="close a session nobody has used for this many seconds (default 600); 0: never",
    )
    add_evidence_arguments(p)
    p.add_argument("--log-level", default="INFO", help="least level logged to stderr")


def run(args: argparse.Namespace) -> int:
    log_to_stderr(args.log_level)
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from dgr_engine.certification.record import default_evidence_dir
    from dgr_engine.errors import EngineError
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.worker import ShardWorker, WorkerConfig

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    config = WorkerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        grace_seconds=args.grace,
        inline_max_rows=args.inline_max_rows,
        inline_max_ms=args.inline_max_ms,
        session_lease_seconds=args.session_lease if args.session_lease > 0 else None,
        evidence_dir=args.evidence if args.evidence is not None else default_evidence_dir(),
        lock_path=args.lock,
        admission_wait_seconds=args.admission_wait,
        stall_seconds=args.stall_seconds,
        resume_grace_seconds=args.resume_grace,
    )
    try:
        model = args.model if args.model is not None else ensure_fixture(args.fixture)
        options = EngineOptions.from_args(args)
        worker = await asyncio.to_thread(
            ShardWorker.load, model, args.layers, config=config, **options.engine_kwargs()
        )
    except (EngineError, OSError, ValueError) as exc:
        logger.error("cannot start the worker: {}", exc)
        return 2
    code = 0
    try:
        if not stop.is_set():
            address = await worker.start()
            print(f"LISTENING {address}", flush=True)
            await stop.wait()
    except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError when it cannot bind
        logger.error("cannot serve on {}:{}: {}", args.host, args.port, exc)
        code = 2
    finally:
        closed = await worker.stop()
    print(f"STOPPED sessions_closed={closed}", flush=True)
    return code
