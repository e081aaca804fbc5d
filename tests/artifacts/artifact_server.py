"""A test HTTP source on 127.0.0.1: serves a directory with range requests, and can cut a
connection after some bytes or hold one open until released."""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-$")


class Behaviour:
    """What the server does; the test changes it between requests."""

    def __init__(self) -> None:
        self.drop_after: list[int] = []
        """For the next requests in order: bytes sent before the connection is cut."""
        self.hold_after: int | None = None
        """Bytes (from the file's start) after which every response waits for ``release``."""
        self.holding = threading.Event()
        self.release = threading.Event()
        self.ignore_range = False
        self.requests: list[tuple[str, int]] = []
        self.lock = threading.Lock()


def _handler(directory: Path, behaviour: Behaviour) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            path = directory / self.path.lstrip("/")
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            match = _RANGE.match(self.headers.get("Range", ""))
            start = int(match.group(1)) if match and not behaviour.ignore_range else 0
            with behaviour.lock:
                behaviour.requests.append((path.name, start))
                drop = behaviour.drop_after.pop(0) if behaviour.drop_after else None
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            end = len(data) if drop is None else min(len(data), start + drop)
            if behaviour.hold_after is not None and start < behaviour.hold_after < end:
                self.wfile.write(data[start : behaviour.hold_after])
                self.wfile.flush()
                behaviour.holding.set()
                behaviour.release.wait(timeout=60)
                return
            self.wfile.write(data[start:end])
            if drop is not None:
                self.close_connection = True

    return Handler


@contextlib.contextmanager
def serving(directory: Path, behaviour: Behaviour) -> Iterator[str]:
    """Serves ``directory`` on 127.0.0.1; yields the base URL; stops the server at the end."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(directory, behaviour))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="artifact-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        behaviour.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
