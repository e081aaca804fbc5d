"""Typed refusals of provisioning and verification: each one line naming the file and what is
wrong. Nothing that raised one of these is ever loaded."""

from __future__ import annotations

from dgr_session.errors import DgrError


class ArtifactError(DgrError):
    """Base of every provisioning and verification refusal."""

    def __init__(self, message: str, *, name: str = "") -> None:
        super().__init__(message)
        self.name = name
        """The manifest's name of the file concerned ("" when none)."""


class ArtifactMissing(ArtifactError):
    """A file the manifest names (and the shard needs) is not in the storage root."""


class ArtifactCorrupt(ArtifactError):
    """A file whose size or chunk hashes disagree with the manifest; it has been quarantined."""

    def __init__(self, message: str, *, name: str = "", quarantined_to: str = "") -> None:
        super().__init__(message, name=name)
        self.quarantined_to = quarantined_to


class SourceMismatch(ArtifactError):
    """The source served bytes other than the manifest's (checked chunk by chunk, twice)."""


class SourceUnavailable(ArtifactError):
    """The source could not be read (absent file, HTTP error, connection lost too often)."""

    def __init__(self, message: str, *, name: str = "", transient: bool = False) -> None:
        super().__init__(message, name=name)
        self.transient = transient
        """Worth asking again (a connection refused or cut), unlike a 404 or a missing file."""


class ArtifactsBusy(ArtifactError):
    """Another fetch or verify holds this storage root."""


class ArtifactUnsafe(ArtifactError):
    """A name in the storage root (a part file, a final file, the state, the lock,
    ``.quarantine``) is a symlink, not a regular file, or a file with other hard links. Nothing
    was read or written through it and the file it points to is untouched; the run stops (a
    worker does not start), and a run after the entry is removed proceeds as usual."""
