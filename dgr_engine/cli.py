"""The ``dgr`` command.

::

    dgr worker --model PATH --layers A:B [--port N] [--host 127.0.0.1] ...
    dgr worker --fixture tiny-llama --layers 0:2 --port 0
    dgr generate --endpoints H:P,H:P,... [--prompt "1 2 3"] [-n 16]
    dgr generate --spawn N --fixture tiny-llama [--prompt ...] [--check]
    dgr fixtures list | build NAME...      (same as python -m dgr_engine.fixtures)

``dgr worker`` prints one line ``LISTENING HOST:PORT`` on stdout once it serves (port 0 picks a
free port), logs to stderr, and on SIGTERM or SIGINT closes every session and the engine, prints
``STOPPED sessions_closed=N`` and exits 0. Exit 2: bad arguments or the model could not be
loaded.

``dgr generate`` runs one route session over workers (``dgr_engine.generate``): the tokens on
stdout, per-stage counters on stderr; ``dgr generate --help`` for its options.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from loguru import logger

_LOG_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "stage={extra[stage]} {extra[session]}/{extra[epoch]} {message}"
)


def _layers(text: str) -> tuple[int, int]:
    begin, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(begin), int(end) if end else -1
    except ValueError:
        message = f"expected A:B (or A: for 'to the end'), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr", description="Distributed GGUF Runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve one layer range of a GGUF over gRPC")
    model = w.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="GGUF file")
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    w.add_argument("--layers", type=_layers, required=True, help="owned range A:B = [A, B)")
    w.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    w.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    w.add_argument("--max-sessions", type=int, default=4)
    w.add_argument("--ctx", type=int, default=512, help="KV positions per session")
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--batch", type=int, default=512, help="most rows per forward")
    w.add_argument("--max-message-bytes", type=int, default=None)
    w.add_argument("--grace", type=float, default=2.0, help="shutdown grace in seconds")
    w.add_argument(
        "--inline-max-rows",
        type=int,
        default=1,
        help="frames of at most this many rows run on the event loop when the engine is idle "
        "(no thread hop; default 1: decode steps); 0 turns it off",
    )
    w.add_argument(
        "--inline-max-ms",
        type=float,
        default=20.0,
        help="...but only while the last such frame took at most this long (default 20)",
    )
    w.add_argument(
        "--session-lease",
        type=float,
        default=600.0,
        help="close a session nobody has used for this many seconds (default 600); 0: never",
    )
    w.add_argument("--log-level", default="INFO")

    g = sub.add_parser("generate", help="generate over a route of workers", add_help=False)
    g.add_argument("args", nargs=argparse.REMAINDER)

    f = sub.add_parser("fixtures", help="list or build the generated fixture models")
    f.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:  # its own parser (argparse's REMAINDER drops leading options)
        from dgr_engine.generate import main as generate_main

        return generate_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "fixtures":
        from dgr_engine.fixtures import main as fixtures_main

        return fixtures_main(args.args)
    logger.remove()
    logger.configure(extra={"stage": "-", "session": "-", "epoch": "-"})
    logger.add(sys.stderr, level=args.log_level.upper(), format=_LOG_FORMAT)
    logger.enable("dgr_engine")
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
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
    )
    try:
        model = args.model if args.model is not None else ensure_fixture(args.fixture)
        worker = await asyncio.to_thread(
            ShardWorker.load,
            model,
            args.layers,
            max_sessions=args.max_sessions,
            n_ctx_per_session=args.ctx,
            n_threads=args.threads,
            n_batch=args.batch,
            n_ubatch=args.batch,
            config=config,
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


if __name__ == "__main__":
    raise SystemExit(main())
