"""Fetching and verifying a manifest's files in a storage root, chunk by chunk, resumably.

``fetch`` copies what a shard needs (every file, or with ``layers`` only the files holding
those layers and what every shard reads) from a :class:`~dgr_engine.artifacts.sources.Source`
into ``NAME.part``, checking each chunk against the manifest before it is written and recording
it in the state; an interrupted fetch resumes at the first unrecorded chunk. A part file becomes
``NAME`` only when every chunk is verified. ``verify`` re-hashes files in place, recording each
chunk, so an interrupted run resumes where it stopped; a file whose size or a chunk differs is
moved to ``.quarantine/`` (a later fetch gets it again) and never served.

One fetch or verify at a time holds a root (``.dgr-artifacts.lock``); a second one is refused.
Every name in the root is opened without following links, relative to the root's directory
(:mod:`dgr_engine.artifacts.rootdir`): a symlinked ``NAME.part``, ``NAME``, lock or quarantine is
refused with :class:`ArtifactUnsafe` and whatever it points to is untouched. A fetched file gets
its final name only once every chunk is verified and its GGUF header read; nothing partial,
empty or unreadable ever carries a final name. The manifest itself cannot be hostile in shape
(:class:`~dgr_engine.artifacts.manifest.FileEntry` refuses it when made), so a file is only
quarantined when its bytes disagree with a manifest that passed validation.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import http.client
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final

import attrs
from loguru import logger

from dgr_engine.artifacts.errors import (
    ArtifactCorrupt,
    ArtifactMissing,
    ArtifactsBusy,
    ArtifactUnsafe,
    SourceMismatch,
    SourceUnavailable,
)
from dgr_engine.artifacts.manifest import FileEntry, Manifest, ManifestInvalid, header_tensors
from dgr_engine.artifacts.rootdir import RootDir
from dgr_engine.artifacts.sources import Source
from dgr_engine.artifacts.state import ArtifactState, part_key
from dgr_engine.artifacts.storage import check_free_space
from dgr_engine.errors import ModelLoadError
from dgr_session.errors import DgrError

QUARANTINE_DIR: Final = ".quarantine"
LOCK_NAME: Final = ".dgr-artifacts.lock"
MAX_SOURCE_FAILURES: Final = 6
"""Consecutive failed reads of one file (no chunk verified in between) before giving up."""
_BACKOFF_S: Final = (0.05, 0.2, 0.5, 1.0, 2.0, 4.0)

ProgressFn = Callable[[str, int, int], None]
"""``(file name, bytes done, bytes total)`` over the whole run, after every chunk."""


@attrs.define
class Report:
    """What one fetch or verify run did."""

    files: tuple[str, ...] = ()
    """The files it covered (the manifest's names)."""
    hashed_chunks: int = 0
    """Chunks read and hashed in this run."""
    trusted_chunks: int = 0
    """Chunks a matching state record already vouched for (not read again)."""
    fetched_bytes: int = 0
    quarantined: list[str] = attrs.field(factory=list)
    """Paths files were moved to because their bytes disagreed with the manifest."""
    problems: list[DgrError] = attrs.field(factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_first(self) -> None:
        if self.problems:
            raise self.problems[0]


@contextlib.contextmanager
def holding(root: Path) -> Iterator[RootDir]:
    """The root, open and locked for one run; :class:`ArtifactsBusy` when another run holds
    it, :class:`ArtifactUnsafe` when the lock's name is a link."""
    with RootDir.open(root, create=True) as directory:
        lock = directory.open_fd(LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ArtifactsBusy(
                    f"storage root {root}: another fetch or verify is running"
                ) from None
            try:
                yield directory
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        finally:
            os.close(lock)


def quarantine(root: RootDir, name: str) -> Path:
    """Moves the entry ``name`` out of the served names into ``root/.quarantine/``."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%f")
    with root.subdir(QUARANTINE_DIR) as place:
        root.move_to(name, place, f"{name}.{stamp}")
        target = place.path / f"{name}.{stamp}"
    logger.warning("artifacts: {} quarantined to {}", name, target)
    return target


class _Tally:
    """Bytes done over the run, for the progress callback."""

    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def add(self, name: str, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(name, self.done, self.total)


def _chunk_span(entry: FileEntry, index: int) -> tuple[int, int]:
    start = index * entry.chunk_bytes
    return start, min(entry.chunk_bytes, entry.size - start)


def _corrupt(root: RootDir, entry: FileEntry, why: str, report: Report) -> None:
    moved = quarantine(root, entry.name)
    report.quarantined.append(str(moved))
    report.problems.append(
        ArtifactCorrupt(
            f"{entry.name}: {why}; quarantined to {moved}",
            name=entry.name,
            quarantined_to=str(moved),
        )
    )


def _check_header(entry: FileEntry, path: Path, report: Report) -> None:
    """A verified file's GGUF header must name the tensors the manifest says it holds."""
    try:
        found = header_tensors(path)
    except ModelLoadError as exc:
        report.problems.append(
            ManifestInvalid(
                f"{entry.name}: its bytes match the manifest but are not a readable GGUF ({exc})",
                field="files.tensors",
            )
        )
        return
    if found != entry.tensors:
        extra = sorted(set(found) - set(entry.tensors))[:3]
        lacking = sorted(set(entry.tensors) - set(found))[:3]
        report.problems.append(
            ManifestInvalid(
                f"{entry.name}: the manifest's tensor (and layer) map disagrees with the GGUF "
                f"header (header only: {extra}, manifest only: {lacking})",
                path=None,
                field="files.tensors",
            )
        )


def _verify_in_place(
    root: RootDir, entry: FileEntry, state: ArtifactState, tally: _Tally, report: Report
) -> bool:
    """Hashes the chunks of ``root/NAME`` the state does not vouch for; quarantines the file on
    the first disagreement. True when the whole file is verified. A link or anything but a
    regular file under the name is reported (:class:`ArtifactUnsafe`) and left alone."""
    try:
        with root.reading(entry.name) as (fd, found):
            if found.st_size != entry.size:
                why = f"{found.st_size} bytes, the manifest says {entry.size}"
                return _disagrees(root, entry, state, why, report)
            start = state.verified_chunks(entry.name, found, len(entry.chunks))
            report.trusted_chunks += start
            done = start * entry.chunk_bytes if start < len(entry.chunks) else entry.size
            tally.add(entry.name, done)
            with os.fdopen(os.dup(fd), "rb") as stream:
                stream.seek(start * entry.chunk_bytes)
                for index in range(start, len(entry.chunks)):
                    _, length = _chunk_span(entry, index)
                    data = stream.read(length)
                    report.hashed_chunks += 1
                    if hashlib.sha256(data).hexdigest() != entry.chunks[index]:
                        why = f"chunk {index} has another sha256"
                        return _disagrees(root, entry, state, why, report)
                    state.record(entry.name, os.fstat(fd), index + 1)
                    tally.add(entry.name, length)
    except FileNotFoundError:
        report.problems.append(
            ArtifactMissing(f"{entry.name}: missing from {root.path}", name=entry.name)
        )
        return False
    except ArtifactUnsafe as exc:
        report.problems.append(exc)
        return False
    _check_header(entry, root.path / entry.name, report)
    return True


def _disagrees(
    root: RootDir, entry: FileEntry, state: ArtifactState, why: str, report: Report
) -> bool:
    _corrupt(root, entry, why, report)
    state.forget(entry.name)
    return False


def verify(
    manifest: Manifest,
    root: Path,
    *,
    layers: tuple[int, int] | None = None,
    progress: ProgressFn | None = None,
    resume: bool = True,
) -> Report:
    """Re-hashes the files a shard of ``layers`` reads (``None``: every file). A run that an
    interruption cut short is resumed (its verified chunks are not read again) unless
    ``resume`` is false; otherwise every chunk is read afresh. Problems are collected in the
    report, one per file."""
    began = time.monotonic()
    targets = manifest.files_for(layers)
    report = Report(files=tuple(e.name for e in targets))
    with holding(root) as directory:
        state = ArtifactState.load(directory, manifest.sha256)
        if not (resume and state.verifying):
            state.verifying = True
            state.verified_at = ""
            for entry in targets:
                state.files.pop(entry.name, None)
            state.save()
        tally = _Tally(sum(e.size for e in targets), progress)
        for entry in targets:
            _verify_in_place(directory, entry, state, tally, report)
        state.verifying = False
        if report.ok:
            state.mark_verified_now()
        state.save()
    report.seconds = time.monotonic() - began
    return report


def trusted(manifest: Manifest, root: Path, layers: tuple[int, int] | None) -> str | None:
    """When the state vouches for every chunk of every file ``layers`` needs, unchanged on disk
    since: the time of that verification (``""`` if unknown); else ``None``."""
    with RootDir.open(root) as directory:
        state = ArtifactState.load(directory, manifest.sha256)
        for entry in manifest.files_for(layers):
            n = len(entry.chunks)
            if state.verified_chunks(entry.name, directory.lstat(entry.name), n) != n:
                return None
    return state.verified_at


def _read_exactly(stream: BinaryIO, length: int) -> bytes:
    parts, got = [], 0
    while got < length:
        block = stream.read(length - got)
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


class _Dropped(Exception):
    """The source stopped before the chunk's end."""


def _download(
    entry: FileEntry,
    source: Source,
    out: int,
    state: ArtifactState,
    tally: _Tally,
    report: Report,
) -> None:
    """Appends the chunks the part file (open as ``out``) lacks, each verified before it is
    written and recorded."""
    key = part_key(entry.name)
    index = state.verified_chunks(key, os.fstat(out), len(entry.chunks))
    os.ftruncate(out, index * entry.chunk_bytes)
    state.record(key, os.fstat(out), index)
    report.trusted_chunks += index
    tally.add(entry.name, index * entry.chunk_bytes)
    failures = mismatches = 0
    while index < len(entry.chunks):
        offset, _ = _chunk_span(entry, index)
        try:
            with source.open(entry.name, offset) as stream:
                while index < len(entry.chunks):
                    offset, length = _chunk_span(entry, index)
                    data = _read_exactly(stream, length)
                    if len(data) < length:
                        raise _Dropped(f"{len(data)} of {length} bytes")
                    report.hashed_chunks += 1
                    if hashlib.sha256(data).hexdigest() != entry.chunks[index]:
                        mismatches += 1
                        if mismatches >= 2:
                            raise SourceMismatch(
                                f"{entry.name}: {source.describe()} serves other bytes than the "
                                f"manifest's for chunk {index} (bytes {offset}..{offset + length})",
                                name=entry.name,
                            )
                        break  # read it once more from a fresh request
                    view = memoryview(data)
                    while view:
                        view = view[os.pwrite(out, view, offset + length - len(view)) :]
                    os.fsync(out)
                    state.record(key, os.fstat(out), index + 1)
                    report.fetched_bytes += length
                    tally.add(entry.name, length)
                    index += 1
                    failures = mismatches = 0
        except (_Dropped, OSError, http.client.HTTPException, SourceUnavailable) as exc:
            if isinstance(exc, SourceUnavailable) and not exc.transient:
                raise
            failures += 1
            if failures >= MAX_SOURCE_FAILURES:
                raise SourceUnavailable(
                    f"{entry.name}: {source.describe()} failed {failures} times in a row at byte "
                    f"{offset} ({exc})",
                    name=entry.name,
                ) from None
            logger.info(
                "artifacts: {} read stopped at byte {} ({}); resuming", entry.name, offset, exc
            )
            time.sleep(_BACKOFF_S[failures - 1])  # back-off before asking the source again


def _provision(
    entry: FileEntry,
    source: Source,
    root: RootDir,
    state: ArtifactState,
    tally: _Tally,
    report: Report,
) -> None:
    """Fetches ``entry`` into ``NAME.part`` and gives it its final name once every chunk is
    verified and its header read; on any failure the final name stays absent."""
    part = part_key(entry.name)
    out = root.open_fd(part, os.O_RDWR | os.O_CREAT, write=True)
    try:
        _download(entry, source, out, state, tally, report)
        before = len(report.problems)
        _check_header(entry, root.path / part, report)
        if len(report.problems) > before:
            return
        root.replace(part, entry.name, written_fd=out)
        state.files.pop(part, None)
        state.record(entry.name, os.fstat(out), len(entry.chunks))
    finally:
        os.close(out)


def fetch(
    manifest: Manifest,
    source: Source,
    root: Path,
    *,
    layers: tuple[int, int] | None = None,
    progress: ProgressFn | None = None,
) -> Report:
    """Provisions the files a shard of ``layers`` needs (``None``: every file) into ``root``.
    A file already there is kept when its chunks verify (the state vouching for those it
    recorded), else quarantined and fetched again. Raises on the first file that cannot be
    provisioned (the files before it stay provisioned, the state records how far it got)."""
    began = time.monotonic()
    targets = manifest.files_for(layers)
    report = Report(files=tuple(e.name for e in targets))
    with holding(root) as directory:
        state = ArtifactState.load(directory, manifest.sha256)
        missing = 0
        for entry in targets:
            if directory.regular(entry.name) is None:
                key = part_key(entry.name)
                done = state.verified_chunks(key, directory.regular(key), len(entry.chunks))
                missing += entry.size - done * entry.chunk_bytes
        check_free_space(root, max(missing, 0))
        tally = _Tally(sum(e.size for e in targets), progress)
        for entry in targets:
            if directory.regular(entry.name) is not None:
                before = len(report.problems)
                if _verify_in_place(directory, entry, state, tally, report):
                    report.raise_first()  # its header disagreed with the manifest
                    continue
                del report.problems[before:]  # a corrupt copy is replaced, not an error here
            _provision(entry, source, directory, state, tally, report)
            report.raise_first()
        state.mark_verified_now()  # every chunk of every file named was verified just now
        state.save()
    report.seconds = time.monotonic() - began
    return report
