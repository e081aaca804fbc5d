"""Where artifact bytes come from: a directory or an HTTP(S) base URL.

A source opens a file at a byte offset and yields its bytes from there; the HTTP source asks for
``Range: bytes=OFFSET-`` and refuses a server that ignores it. Reading stops short when the
connection drops; the caller then reopens at the first byte it has not verified.
"""

from __future__ import annotations

import contextlib
import http.client
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from dgr_engine.artifacts.errors import SourceUnavailable

REQUEST_TIMEOUT_S = 30.0
"""Seconds an HTTP request may wait for the server (connect, or between two reads)."""


class Source(Protocol):
    """Bytes of the manifest's files, by name and offset."""

    def describe(self) -> str: ...

    def open(self, name: str, offset: int) -> contextlib.AbstractContextManager[BinaryIO]:
        """The file ``name`` positioned at ``offset``; :class:`SourceUnavailable` when it
        cannot be opened. Reads may return fewer bytes than asked, or ``b""`` early when the
        connection drops."""
        ...


class DirectorySource:
    """Files in a local (or mounted) directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def describe(self) -> str:
        return str(self.directory)

    @contextlib.contextmanager
    def open(self, name: str, offset: int) -> Iterator[BinaryIO]:
        try:
            stream = (self.directory / name).open("rb")
        except OSError as exc:
            raise SourceUnavailable(
                f"{name}: not readable in {self.directory}: {exc.strerror}", name=name
            ) from None
        with stream:
            stream.seek(offset)
            yield stream


class HttpSource:
    """Files under an HTTP(S) base URL (``BASE/NAME``), read with range requests."""

    def __init__(self, base_url: str, *, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return self.base_url

    @contextlib.contextmanager
    def open(self, name: str, offset: int) -> Iterator[BinaryIO]:
        url = f"{self.base_url}/{urllib.parse.quote(name)}"
        request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)  # noqa: S310
        except urllib.error.HTTPError as exc:
            raise SourceUnavailable(
                f"{name}: {url} answered HTTP {exc.code}", name=name, transient=exc.code >= 500
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise SourceUnavailable(
                f"{name}: {url} unreachable: {reason}", name=name, transient=True
            ) from None
        with response:
            if offset > 0 and response.status != 206:
                raise SourceUnavailable(
                    f"{name}: {url} ignored the range request (HTTP {response.status}); "
                    "resuming needs a server that honours Range",
                    name=name,
                )
            yield response


def source_for(where: str) -> Source:
    """An HTTP(S) source for a URL, a directory source otherwise."""
    scheme = urllib.parse.urlsplit(where).scheme
    if scheme in ("http", "https"):
        return HttpSource(where)
    directory = Path(where).expanduser()
    if not directory.is_dir():
        raise SourceUnavailable(f"source {where}: not a directory nor an http(s) URL")
    return DirectorySource(directory)
