"""What a worker serving a layer range of a split model does with its files before loading.

It reads only the files :meth:`Manifest.files_for` names for its range; every one must be in
the storage root as a regular file (a symlink is refused). Their bytes are then hashed, every
chunk, whatever the verification state says (:mod:`dgr_engine.artifacts.content`): the state
and the files' sizes and times can be rewritten by anyone who can write the root, so they only
decide how the check is reported. When a state vouches for every file, unchanged on disk since,
the files are hashed side by side and read only (the advert says ``trusted state of <UTC
time>, re-hashed at start-up``); otherwise they are verified afresh by
:func:`provision.verify` (the advert says ``verified at start-up``), which records a new state.
A file that disagrees is quarantined and the worker refuses to start: nothing unverified, and
nothing that differs from the manifest, is loaded. What remains assumed is that nobody rewrites
the files between this check and the engine mapping them (seconds, during start-up).
"""

from __future__ import annotations

from pathlib import Path

import attrs
from loguru import logger

from dgr_engine.artifacts import provision
from dgr_engine.artifacts.content import check_content
from dgr_engine.artifacts.errors import ArtifactMissing
from dgr_engine.artifacts.manifest import Manifest
from dgr_engine.artifacts.rootdir import RootDir


@attrs.frozen
class ShardArtifacts:
    """A range's verified files."""

    manifest: Manifest
    root: Path
    layers: tuple[int, int]
    files: tuple[Path, ...]
    """The files the shard reads, in split order; the first is what llama.cpp opens."""
    verification: str
    """How they were verified, as the advert states it: ``verified at start-up`` or
    ``trusted state of <UTC time>, re-hashed at start-up``."""

    @property
    def first(self) -> Path:
        return self.files[0]

    @property
    def bytes_on_disk(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def prepare(
    manifest: Manifest,
    root: Path,
    layers: tuple[int, int],
    *,
    progress: provision.ProgressFn | None = None,
) -> ShardArtifacts:
    """The files ``layers`` needs, every chunk hashed against the manifest now; raises
    :class:`ArtifactMissing` naming the first absent file, :class:`ArtifactUnsafe` for a link
    in a file's place, or the verification's first problem (:class:`ArtifactCorrupt`)."""
    entries = manifest.files_for(layers)
    with RootDir.open(root) as directory:
        for entry in entries:
            if directory.regular(entry.name) is None:
                begin, end = layers
                raise ArtifactMissing(
                    f"{entry.name}: missing from {root} (layers {begin}:{'' if end < 0 else end} "
                    "need it; provision it with dgr artifacts fetch --layers)",
                    name=entry.name,
                )
        when = provision.trusted(manifest, root, layers)
        check = check_content(directory, entries) if when is not None else None
    paths = tuple(root / entry.name for entry in entries)
    if check is not None and check.ok:
        statement = f"trusted state of {when or 'unknown time'}, re-hashed at start-up"
        logger.bind(root=str(root)).info(
            "artifacts: {} files, {:.2f} GiB re-hashed in {:.2f} s",
            len(entries),
            check.nbytes / 2**30,
            check.seconds,
        )
        return ShardArtifacts(manifest, root, layers, paths, statement)
    if check is not None:
        logger.bind(root=str(root)).warning(
            "artifacts: the state vouched for files whose bytes disagree ({}); verifying afresh",
            check.problems[0],
        )
    # afresh: a state claiming an interrupted run (verifying) is not taken at its word either
    report = provision.verify(manifest, root, layers=layers, progress=progress, resume=False)
    report.raise_first()
    if check is not None:  # the file changed back meanwhile: still refuse what was seen
        raise check.problems[0]
    return ShardArtifacts(manifest, root, layers, paths, "verified at start-up")
