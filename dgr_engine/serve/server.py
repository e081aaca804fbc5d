"""Runs the app with uvicorn on a socket bound here, so that the URL is known (``--port 0``:
any free port) and printed once the socket listens; SIGINT and SIGTERM stop the server
(streams in flight end), after which the caller closes the route and stops its workers."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops the server."""


class _Server(uvicorn.Server):
    """uvicorn's server whose stop signals only stop it: uvicorn's own handling raises the
    signal again once it has stopped, which would cut the route's closing short."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (a server run by a test's thread)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_stop()
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port); ``OSError`` when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a listening socket."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    on_stop: Callable[[], None] = lambda: None,
    log_level: str = "warning",
) -> None:
    """Serves ``app`` on ``sock`` until SIGINT or SIGTERM (``on_stop`` is called at the first);
    returns when the server has stopped."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
        access_log=False,
    )
    await _Server(config, on_stop).serve(sockets=[sock])
