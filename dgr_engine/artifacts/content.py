"""The content check a worker runs at load: every chunk of every file it reads, hashed.

No record on disk is taken for proof: sizes, modification times and the verification state can
all be rewritten by whoever can write the storage root (a same-size swap with its mtime put back
by ``os.utime``, a hand-edited ``.dgr-state``). What a shard loads is therefore read and hashed,
chunk by chunk against the manifest, before the engine opens it; the only thing trusted is the
manifest the operator gave. The check only reads (opened without following links, relative to
the root), never records or moves anything, and hashes the files side by side in threads
(``hashlib`` releases the GIL), so its cost is the read plus SHA-256 at the machine's speed:
``python -m benchmarks.artifact_verify`` measures it in seconds per GiB.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
from collections.abc import Sequence

import attrs

from dgr_engine.artifacts.errors import ArtifactCorrupt, ArtifactError, ArtifactMissing
from dgr_engine.artifacts.manifest import FileEntry
from dgr_engine.artifacts.rootdir import RootDir


@attrs.frozen
class ContentCheck:
    """What hashing a shard's files found."""

    problems: tuple[ArtifactError, ...]
    """One per file that is absent, unsafe, of another size or with a chunk that differs."""
    nbytes: int
    """Bytes read and hashed."""
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_file(root: RootDir, entry: FileEntry) -> tuple[ArtifactError | None, int]:
    try:
        with root.reading(entry.name) as (fd, found):
            if found.st_size != entry.size:
                return ArtifactCorrupt(
                    f"{entry.name}: {found.st_size} bytes, the manifest says {entry.size}",
                    name=entry.name,
                ), 0
            buffer = bytearray(entry.chunk_bytes)
            view = memoryview(buffer)
            done = 0
            for index, want in enumerate(entry.chunks):
                length = min(entry.chunk_bytes, entry.size - done)
                got = 0
                while got < length:
                    n = os.readv(fd, [view[got:length]])
                    if n == 0:
                        break
                    got += n
                if got < length or hashlib.sha256(view[:length]).hexdigest() != want:
                    return ArtifactCorrupt(
                        f"{entry.name}: chunk {index} has another sha256 than the manifest's",
                        name=entry.name,
                    ), done + got
                done += length
            return None, done
    except FileNotFoundError:
        return ArtifactMissing(f"{entry.name}: missing from {root.path}", name=entry.name), 0
    except ArtifactError as exc:
        return exc, 0


def check_content(
    root: RootDir, entries: Sequence[FileEntry], *, threads: int | None = None
) -> ContentCheck:
    """Hashes every chunk of ``entries`` in ``root`` against the manifest, ``threads`` files at
    a time (default: one per file, at most one per CPU)."""
    began = time.perf_counter()
    workers = max(1, min(len(entries), threads or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dgr-hash") as pool:
        results = list(pool.map(lambda entry: _check_file(root, entry), entries))
    problems = tuple(problem for problem, _ in results if problem is not None)
    nbytes = sum(n for _, n in results)
    return ContentCheck(problems, nbytes, time.perf_counter() - began)
