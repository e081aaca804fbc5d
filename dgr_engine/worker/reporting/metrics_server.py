"""Serving a worker's metrics over HTTP: ``/metrics`` of one Prometheus registry, in a thread.

Plaintext by default, on loopback unless the worker is told otherwise (``--metrics-host``).
With the worker's own TLS (``--metrics-tls``) it serves HTTPS with the worker's certificate and,
when the worker requires client certificates (mutual TLS), requires a client certificate of
the same CA: the metrics are then as authenticated as the frames. Each connection's TLS
handshake runs in its own handler thread, with a timeout, so a client that connects and says
nothing never holds up the others. The certificate and key are in memory
(``dgr_engine.security.tls.ServerTls``) and Python's ``ssl`` loads them from files only: they are
written into a private temporary folder (mode 0700) for the load and deleted at once.
"""

from __future__ import annotations

import os
import socket
import socketserver
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from dgr_engine.security.tls import ServerTls

HANDSHAKE_SECONDS = 10.0
"""How long one connection may take for its TLS handshake and its request."""


def tls_context(tls: ServerTls) -> ssl.SSLContext:
    """An HTTPS server context with ``tls``'s certificate and key, requiring client
    certificates of its client CA when it has one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="dgr-metrics-tls-") as folder:
        cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        for path, data in ((cert, tls.cert_chain), (key, tls.private_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        context.load_cert_chain(certfile=cert, keyfile=key)
    if tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _QuietHandler(WSGIRequestHandler):
    timeout = HANDSHAKE_SECONDS  # StreamRequestHandler sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged (the worker's log is for sessions)."""


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's own thread: the TLS handshake first (bounded), then HTTP."""
        if self.context is not None:
            request.settimeout(HANDSHAKE_SECONDS)
            try:
                request = self.context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return  # not TLS, no or a foreign client certificate, or too slow: dropped
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed mid-request (the scraper went away) is dropped quietly."""


class _Server6(_MetricsServer):
    address_family = socket.AF_INET6


class MetricsHttpServer:
    """``/metrics`` of ``registry`` on ``host:port`` (0: a free port), in a daemon thread,
    plaintext or over ``tls``. ``stop()`` ends it."""

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, tls: ServerTls | None
    ) -> None:
        server_class = _Server6 if ":" in host else _MetricsServer
        context = None if tls is None else tls_context(tls)
        self._server = make_server(
            host.strip("[]"),
            port,
            make_wsgi_app(registry),
            server_class,
            handler_class=_QuietHandler,
        )
        assert isinstance(self._server, _MetricsServer)
        self._server.context = context
        self.port = int(self._server.server_port)
        """The bound port."""
        self.tls = tls is not None
        """Served over TLS."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dgr-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
