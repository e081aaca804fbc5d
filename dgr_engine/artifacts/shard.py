"""What a worker serving a layer range of a split model does with its files before loading.

It reads only the files :meth:`Manifest.files_for` names for its range; every one must be in
the storage root. A verification state that vouches for each of those files, unchanged on disk
since, is trusted (the advert says so, with the time of that verification); otherwise they are
verified now (resuming an interrupted run). Nothing unverified is loaded.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from dgr_engine.artifacts import provision
from dgr_engine.artifacts.errors import ArtifactMissing
from dgr_engine.artifacts.manifest import Manifest


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
    ``trusted state of <UTC time>``."""

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
    """The files ``layers`` needs, verified (or vouched for by a fresh state); raises
    :class:`ArtifactMissing` naming the first absent file, or the verification's first
    problem."""
    entries = manifest.files_for(layers)
    for entry in entries:
        if not (root / entry.name).is_file():
            begin, end = layers
            raise ArtifactMissing(
                f"{entry.name}: missing from {root} (layers {begin}:{'' if end < 0 else end} "
                "need it; provision it with dgr artifacts fetch --layers)",
                name=entry.name,
            )
    paths = tuple(root / entry.name for entry in entries)
    when = provision.trusted(manifest, root, layers)
    if when is not None:
        statement = f"trusted state of {when or 'unknown time'}"
        return ShardArtifacts(manifest, root, layers, paths, statement)
    provision.verify(manifest, root, layers=layers, progress=progress).raise_first()
    return ShardArtifacts(manifest, root, layers, paths, "verified at start-up")
