"""Typed refusals of the certification layer: every one names the file and the field."""

from __future__ import annotations

from pathlib import Path

from dgr_session.errors import DgrError


class EvidenceError(DgrError):
    """Base of the certification layer's errors."""

    def __init__(self, message: str, *, path: Path | str | None = None, field: str = "") -> None:
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{message}")
        #: The file refused, when there is one.
        self.path = None if path is None else Path(path)
        #: The offending field (dotted), or ``""``.
        self.field = field


class EvidenceInvalid(EvidenceError):
    """A record or a lock that is malformed, truncated, of an unknown schema, or tampered with
    (its id is not the hash of its content)."""


class LockMismatch(EvidenceError):
    """A record made under another lock than the one evaluated, or before the lock's time."""


class UnclassifiableModel(EvidenceError):
    """The facts do not derive an evidence class: a GGUF that is not a generated fixture and
    that the lock does not name as a real model."""


class LockNotCommitted(EvidenceError):
    """The lock has changes that are not committed: results may not be made under it."""


class SignatureRefused(EvidenceError):
    """A record whose certifier signature does not count under the lock: unsigned, signed by a
    key the lock does not declare, a signature that does not verify (the record was edited
    after it was signed, or the signature is another record's), or a key the lock does not
    trust for the record's evidence class. The record is not used; the others still are."""

    def __init__(
        self, message: str, *, path: Path | str | None = None, key_id: str = "", reason: str = ""
    ) -> None:
        super().__init__(message, path=path, field="signature")
        #: The key the record names (``""``: unsigned).
        self.key_id = key_id
        #: ``unsigned``, ``unknown key``, ``bad signature`` or ``key not trusted for class``.
        self.reason = reason


class ReleaseUnproven(EvidenceError):
    """A record claiming a release build that this checkout cannot confirm: a dirty or unknown
    commit, a version that is not final, or no release tag of that version at that commit.
    The record is not used."""
