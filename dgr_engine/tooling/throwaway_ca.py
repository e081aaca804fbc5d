"""Throwaway certificate authorities and certificates for local runs (the demo, the examples,
the tests): a self-signed CA, server certificates valid for ``localhost`` and ``127.0.0.1``,
client certificates, all written as PEM files. Not for production: a real deployment's
certificates come from the operator's own PKI."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dgr_engine.security.tls import ClientTls


@attrs.frozen
class Issued:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


@attrs.frozen
class Authority:
    """A CA: its certificate file, and what it signs with."""

    name: str
    cert: Path
    key_obj: ec.EllipticCurvePrivateKey
    cert_obj: x509.Certificate
    directory: Path

    def issue(
        self, common_name: str, *, client: bool = False, addresses: Sequence[str] = ()
    ) -> Issued:
        """A certificate for ``common_name`` (a server one valid for localhost, 127.0.0.1 and
        ``addresses``, or a client one), signed by this authority."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert_obj.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if client:
            usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
        else:
            usage = [ExtendedKeyUsageOID.SERVER_AUTH]
            names: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        cert = builder.sign(self.key_obj, hashes.SHA256())
        stem = self.directory / f"{self.name}-{common_name}"
        cert_path, key_path = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert_path, key_path)


def authority(directory: Path, name: str) -> Authority:
    """A fresh self-signed CA named ``name``, its certificate written to ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dgr test CA {name}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}-ca.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(name, path, key, cert, directory)


@attrs.frozen
class LocalPki:
    """What a local TLS run needs: the CA, one worker certificate, one client certificate."""

    ca: Path
    worker: Issued
    client: Issued

    def client_tls(self) -> ClientTls:
        """A client's side: trusts the CA, shows the client certificate."""
        return ClientTls.from_files(self.ca, self.client.cert, self.client.key)

    def worker_args(self) -> list[str]:
        """``dgr worker`` arguments: TLS with the worker certificate, client certificates of
        the CA required (mutual TLS)."""
        return [
            "--tls-cert",
            str(self.worker.cert),
            "--tls-key",
            str(self.worker.key),
            "--client-ca",
            str(self.ca),
        ]

    def chain_args(self) -> list[str]:
        """``dgr worker`` arguments: dial the next stage of a chained route over TLS,
        trusting the CA and showing the client certificate."""
        return [
            "--chain-tls-ca",
            str(self.ca),
            "--chain-tls-cert",
            str(self.client.cert),
            "--chain-tls-key",
            str(self.client.key),
        ]


def local_pki(directory: Path, addresses: Sequence[str] = ()) -> LocalPki:
    """A fresh CA in ``directory`` with a worker certificate (valid on loopback and at
    ``addresses``) and a client certificate."""
    ca = authority(directory, "local")
    worker = ca.issue("worker", addresses=addresses)
    return LocalPki(ca.cert, worker, ca.issue("client", client=True))
