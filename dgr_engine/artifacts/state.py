"""What has been verified in a storage root, kept beside the files and written atomically.

One JSON document per manifest (``.dgr-state-<manifest sha256[:16]>.json`` in the root) records,
for each file, how many of its leading chunks have been verified and the size and modification
time the file had then; a file whose size or time has changed since is not trusted at all. A
partially fetched file lives as ``NAME.part`` and has its own record. ``verifying`` is true while
a ``verify`` run is under way, so an interrupted run resumes instead of starting over.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Final

import attrs

from dgr_engine.atomic import replacing

STATE_SCHEMA: Final = "dgr.artifacts-state/1"
PART_SUFFIX: Final = ".part"


def state_path(root: Path, manifest_sha256: str) -> Path:
    """Where the state of ``manifest_sha256``'s files in ``root`` lives."""
    return root / f".dgr-state-{manifest_sha256[:16]}.json"


@attrs.frozen
class FileRecord:
    """The verified prefix of one file (or ``NAME.part``) as it was on disk."""

    chunks: int
    """Leading chunks verified."""
    size: int
    mtime_ns: int

    def matches(self, path: Path) -> bool:
        """The file at ``path`` is still the one recorded (same size and modification time)."""
        try:
            stat = path.stat()
        except OSError:
            return False
        return stat.st_size == self.size and stat.st_mtime_ns == self.mtime_ns

    @classmethod
    def of(cls, path: Path, chunks: int) -> FileRecord:
        stat = path.stat()
        return cls(chunks=chunks, size=stat.st_size, mtime_ns=stat.st_mtime_ns)


@attrs.define
class ArtifactState:
    """The state of one manifest's files in one root; :meth:`save` writes it atomically."""

    path: Path
    manifest_sha256: str
    files: dict[str, FileRecord] = attrs.field(factory=dict)
    verifying: bool = False
    """A verify run started and has not finished."""
    verified_at: str = ""
    """When the last complete verification of every file named finished (UTC, ISO 8601)."""

    @classmethod
    def load(cls, root: Path, manifest_sha256: str) -> ArtifactState:
        """The recorded state, or an empty one when there is none or it cannot be read (an
        unreadable state only costs re-hashing)."""
        path = state_path(root, manifest_sha256)
        empty = cls(path=path, manifest_sha256=manifest_sha256)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return empty
        if (
            not isinstance(data, dict)
            or data.get("schema") != STATE_SCHEMA
            or data.get("manifest") != manifest_sha256
        ):
            return empty
        try:
            files = {
                str(name): FileRecord(int(r["chunks"]), int(r["size"]), int(r["mtime_ns"]))
                for name, r in dict(data.get("files", {})).items()
            }
        except (KeyError, TypeError, ValueError):
            return empty
        return cls(
            path=path,
            manifest_sha256=manifest_sha256,
            files=files,
            verifying=bool(data.get("verifying", False)),
            verified_at=str(data.get("verified_at", "")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "manifest": self.manifest_sha256,
            "verifying": self.verifying,
            "verified_at": self.verified_at,
            "files": {
                name: {"chunks": r.chunks, "size": r.size, "mtime_ns": r.mtime_ns}
                for name, r in sorted(self.files.items())
            },
        }

    def save(self) -> None:
        with replacing(self.path) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    def verified_chunks(self, key: str, path: Path) -> int:
        """Leading chunks of ``path`` known to be verified (0 unless the record still matches
        the file on disk)."""
        record = self.files.get(key)
        return record.chunks if record is not None and record.matches(path) else 0

    def record(self, key: str, path: Path, chunks: int) -> None:
        self.files[key] = FileRecord.of(path, chunks)
        self.save()

    def forget(self, key: str) -> None:
        if self.files.pop(key, None) is not None:
            self.save()

    def mark_verified_now(self) -> None:
        self.verified_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def part_key(name: str) -> str:
    """The state key (and file name) of a partially fetched ``name``."""
    return name + PART_SUFFIX


def fsync_file(path: Path) -> None:
    """Flushes ``path``'s bytes to the disk before the state may claim them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
