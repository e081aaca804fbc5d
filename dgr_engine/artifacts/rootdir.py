"""File operations inside a storage root that never follow a link and never leave the root.

Every name is one plain component opened relative to the root's own directory descriptor
(``dir_fd``) with ``O_NOFOLLOW``: a symlink (or a directory, a FIFO, a device) where a part file,
a final file, the state, the lock or ``.quarantine`` should be is refused with
:class:`ArtifactUnsafe` and nothing is read or written through it. A file opened for writing
must also have one link only (a hard link to a file elsewhere is refused the same way). Renames
are ``renameat`` within the root, and after a rename the final name is checked to be the very
file that was written. The root path itself is resolved once by the storage policy; what an
attacker may change afterwards is the names inside it, and those are what this guards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from dgr_engine.artifacts.errors import ArtifactUnsafe

_OPEN_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW: Final = os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(root: Path, name: str, what: str) -> ArtifactUnsafe:
    return ArtifactUnsafe(
        f"{name}: {what} in {root}; refused (nothing is read or written through it; remove it "
        "and run again)",
        name=name,
    )


class RootDir:
    """An open storage root; :meth:`close` (or ``with``) releases its descriptor."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: Path, *, create: bool = False) -> RootDir:
        """The root at ``path`` (made first when ``create``)."""
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(path, os.open(path, _OPEN_DIR))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RootDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a link is not followed); ``None`` when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def regular(self, name: str) -> os.stat_result | None:
        """``name``'s status when it is a regular file; ``None`` when absent;
        :class:`ArtifactUnsafe` when it is a link or anything else."""
        found = self.lstat(name)
        if found is not None and not stat.S_ISREG(found.st_mode):
            raise _refused(self.path, name, _kind(found))
        return found

    def open_fd(self, name: str, flags: int, *, write: bool = False) -> int:
        """A descriptor of the regular file ``name`` (``O_NOFOLLOW`` added);
        :class:`ArtifactUnsafe` for a link, a non-regular file, or (``write``) a file with
        other hard links."""
        try:
            fd = os.open(name, flags | _NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(self.path, name, "a symlink") from None
            raise
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise _refused(self.path, name, _kind(found))
            if write and found.st_nlink != 1:
                raise _refused(self.path, name, f"a file with {found.st_nlink} hard links")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[tuple[int, os.stat_result]]:
        """The regular file ``name`` open for reading, with its status."""
        fd = self.open_fd(name, os.O_RDONLY)
        try:
            yield fd, os.fstat(fd)
        finally:
            os.close(fd)

    def read_bytes(self, name: str) -> bytes:
        with self.reading(name) as (fd, _), os.fdopen(os.dup(fd), "rb") as stream:
            return stream.read()

    def replace(self, src: str, dst: str, *, written_fd: int | None = None) -> None:
        """Renames ``src`` to ``dst`` inside the root. With ``written_fd`` (the descriptor the
        caller wrote ``src`` through) the rename happens only if ``src`` is still that file,
        and ``dst`` is checked to be it afterwards (else the name is removed, and refused)."""
        if written_fd is not None and not self._is(src, written_fd):
            raise _refused(self.path, src, "not the file that was written (it was swapped)")
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        if written_fd is not None and not self._is(dst, written_fd):
            with contextlib.suppress(OSError):
                os.unlink(dst, dir_fd=self.fd)
            raise _refused(self.path, dst, "not the file that was written (it was swapped)")

    def _is(self, name: str, fd: int) -> bool:
        found, mine = self.lstat(name), os.fstat(fd)
        return (
            found is not None
            and stat.S_ISREG(found.st_mode)
            and (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)
        )

    def unlink(self, name: str) -> None:
        """Removes the entry ``name`` (a link itself, never what it points to), if there."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def write_atomic(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Writes ``name`` whole or not at all: a fresh temporary (``O_EXCL``, no link
        followed) in the root, flushed, then renamed over ``name`` (a link there is replaced,
        never followed)."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        finally:
            self.unlink(tmp)

    @contextlib.contextmanager
    def subdir(self, name: str) -> Iterator[RootDir]:
        """The directory ``name`` in the root (made when absent; a link there is refused)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=self.fd)
        try:
            fd = os.open(name, _OPEN_DIR | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refused(self.path, name, "not a plain directory") from None
            raise
        with RootDir(self.path / name, fd) as inner:
            yield inner

    def move_to(self, name: str, directory: RootDir, new_name: str) -> None:
        """Moves the entry ``name`` (itself, never a link's target) into ``directory``."""
        os.replace(name, new_name, src_dir_fd=self.fd, dst_dir_fd=directory.fd)


def _kind(found: os.stat_result) -> str:
    if stat.S_ISLNK(found.st_mode):
        return "a symlink"
    if stat.S_ISDIR(found.st_mode):
        return "a directory"
    return "not a regular file"


@contextlib.contextmanager
def opened(root: Path | RootDir) -> Iterator[RootDir]:
    """``root`` as an open :class:`RootDir` (one given open stays open)."""
    if isinstance(root, RootDir):
        yield root
        return
    with RootDir.open(root) as directory:
        yield directory
