"""What has been verified in a storage root, kept beside the files and written atomically.

One JSON document per manifest (``.dgr-state-<manifest sha256[:16]>.json`` in the root) records,
for each file, how many of its leading chunks have been verified and the file's identity then:
size, modification time, inode and change time (``st_ctime``, which ``os.utime`` cannot restore:
writing the file, renaming another over it, or resetting its mtime all move it). A file whose
identity has changed since is not trusted at all. A partially fetched file lives as
``NAME.part`` and has its own record. ``verifying`` is true while a ``verify`` run is under way,
so an interrupted run resumes instead of starting over.

The state is a progress record, not a proof: anyone who can write the root can write it too.
It lets ``fetch`` and ``verify`` skip work; a worker hashes its files at load whatever it says
(:mod:`dgr_engine.artifacts.content`). It is read and written without following links
(:mod:`dgr_engine.artifacts.rootdir`).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Final

import attrs

from dgr_engine.artifacts.errors import ArtifactUnsafe
from dgr_engine.artifacts.rootdir import RootDir, opened

STATE_SCHEMA: Final = "dgr.artifacts-state/2"
PART_SUFFIX: Final = ".part"


def state_path(root: Path, manifest_sha256: str) -> Path:
    """Where the state of ``manifest_sha256``'s files in ``root`` lives."""
    return root / state_name(manifest_sha256)


def state_name(manifest_sha256: str) -> str:
    """The state's file name in the root."""
    return f".dgr-state-{manifest_sha256[:16]}.json"


@attrs.frozen
class FileRecord:
    """The verified prefix of one file (or ``NAME.part``) as it was on disk."""

    chunks: int
    """Leading chunks verified."""
    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int

    def matches(self, found: os.stat_result | None) -> bool:
        """The file whose status is ``found`` is still the one recorded."""
        return found is not None and self == FileRecord.of(found, self.chunks)

    @classmethod
    def of(cls, found: os.stat_result, chunks: int) -> FileRecord:
        return cls(
            chunks=chunks,
            size=found.st_size,
            mtime_ns=found.st_mtime_ns,
            ino=found.st_ino,
            ctime_ns=found.st_ctime_ns,
        )


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
    directory: RootDir | None = attrs.field(default=None, eq=False, repr=False)
    """The open root to write through (``None``: :meth:`save` opens it)."""

    @classmethod
    def load(cls, root: Path | RootDir, manifest_sha256: str) -> ArtifactState:
        """The recorded state, or an empty one when there is none or it cannot be read (an
        unreadable state, or a link in its place, only costs re-hashing)."""
        where = root.path if isinstance(root, RootDir) else root
        directory = root if isinstance(root, RootDir) else None
        path = state_path(where, manifest_sha256)
        empty = cls(path=path, manifest_sha256=manifest_sha256, directory=directory)
        try:
            with opened(root) as open_root:
                data = json.loads(open_root.read_bytes(state_name(manifest_sha256)))
        except (OSError, ValueError, ArtifactUnsafe):
            return empty
        if (
            not isinstance(data, dict)
            or data.get("schema") != STATE_SCHEMA
            or data.get("manifest") != manifest_sha256
        ):
            return empty
        try:
            files = {
                str(name): FileRecord(
                    int(r["chunks"]),
                    int(r["size"]),
                    int(r["mtime_ns"]),
                    int(r["ino"]),
                    int(r["ctime_ns"]),
                )
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
            directory=directory,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "manifest": self.manifest_sha256,
            "verifying": self.verifying,
            "verified_at": self.verified_at,
            "files": {name: attrs.asdict(record) for name, record in sorted(self.files.items())},
        }

    def save(self) -> None:
        text = json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"
        with opened(self.directory or self.path.parent) as root:
            root.write_atomic(self.path.name, text.encode())

    def verified_chunks(self, key: str, found: os.stat_result | None, limit: int) -> int:
        """Leading chunks (at most ``limit``) of the file whose status is ``found`` known to be
        verified: 0 unless the record still matches the file on disk."""
        record = self.files.get(key)
        if record is None or not record.matches(found):
            return 0
        return min(max(record.chunks, 0), limit)

    def record(self, key: str, found: os.stat_result, chunks: int) -> None:
        self.files[key] = FileRecord.of(found, chunks)
        self.save()

    def forget(self, key: str) -> None:
        if self.files.pop(key, None) is not None:
            self.save()

    def mark_verified_now(self) -> None:
        self.verified_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def part_key(name: str) -> str:
    """The state key (and file name) of a partially fetched ``name``."""
    return name + PART_SUFFIX
