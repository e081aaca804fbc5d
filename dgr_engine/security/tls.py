"""TLS between clients and workers (gRPC's own TLS): what a worker serves with and what a
client trusts.

A worker with a certificate and key serves TLS only; with a client CA as well it requires a
client certificate signed by that CA (mutual TLS). Without TLS a worker serves plaintext, which
is allowed on a loopback address only, unless the caller says so explicitly
(``allow_plaintext_remote``; the worker then logs a warning at every start). Files are read when
the config is made, so a missing or unreadable one is one line before anything binds.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import attrs
import grpc

from dgr_session.errors import DgrError


class TlsConfigError(DgrError, ValueError):
    """A certificate, key or CA file that cannot be read, or a plaintext bind the policy
    refuses."""


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{what} {path}: not readable ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{what} {path}: not a PEM file")
    return data


@attrs.frozen
class ServerTls:
    """A worker's certificate chain and key, and the CA its clients' certificates must have
    (``None``: no client certificate asked)."""

    cert_chain: bytes = attrs.field(repr=False)
    private_key: bytes = attrs.field(repr=False)
    client_ca: bytes | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_files(
        cls,
        cert: str | os.PathLike[str],
        key: str | os.PathLike[str],
        client_ca: str | os.PathLike[str] | None = None,
    ) -> ServerTls:
        return cls(
            _read(cert, "TLS certificate"),
            _read(key, "TLS key"),
            None if client_ca is None else _read(client_ca, "client CA"),
        )

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.mutual,
        )


@attrs.frozen
class ClientTls:
    """The CA a client trusts for workers' certificates, and its own certificate and key for
    workers that ask for one. ``server_name``: the name to check the worker's certificate
    against when it differs from the address dialled (tests: a certificate for ``localhost``)."""

    ca: bytes = attrs.field(repr=False)
    cert_chain: bytes | None = attrs.field(default=None, repr=False)
    private_key: bytes | None = attrs.field(default=None, repr=False)
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        ca: str | os.PathLike[str],
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        *,
        server_name: str | None = None,
    ) -> ClientTls:
        if (cert is None) != (key is None):
            raise TlsConfigError("a client certificate needs its key, and a key its certificate")
        return cls(
            _read(ca, "CA"),
            None if cert is None else _read(cert, "client certificate"),
            None if key is None else _read(key, "client key"),
            server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def is_loopback(host: str) -> bool:
    """``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_bind(host: str, allow_plaintext_remote: bool) -> None:
    """:class:`TlsConfigError` when plaintext would be served on ``host`` beyond loopback
    without the explicit permission."""
    if not is_loopback(host) and not allow_plaintext_remote:
        raise TlsConfigError(
            f"refusing to serve plaintext on {host}: give --tls-cert and --tls-key, or "
            "--allow-plaintext-remote to accept that anyone on the network reads and injects "
            "frames"
        )
